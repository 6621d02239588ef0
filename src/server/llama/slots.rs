//! llama-server's `GET /slots`: one entry per decode slot (`total_slots`, the decode batch),
//! the sequences being computed first, then the idle slots. What each sequence is doing is given
//! as counts (prompt tokens, how many are prefilled and were cached, tokens decoded and
//! remaining); unlike llama-server, never its prompt, output text or sampling settings (its
//! seed would let another client predict its output): one client must not read another's. `?fail_on_no_slot=1` answers 503 when every slot is busy.
//! Behind the API key when one is set.

use super::super::error::ApiError;
use super::super::AppState;
use crate::engine::slots::SlotState;
use axum::extract::{Query, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

/// How long `/slots` waits for the engine to answer (it answers between steps).
const ANSWER_WITHIN: Duration = Duration::from_secs(30);

pub(super) async fn slots(State(st): State<Arc<AppState>>, Query(q): Query<HashMap<String, String>>) -> Response {
    let r = async {
        let e = st.engine()?;
        let engine_gone = |_| ApiError::unavailable("the engine has stopped", "engine_down");
        let states = tokio::time::timeout(ANSWER_WITHIN, e.slots())
            .await
            .map_err(|_| ApiError::unavailable("the engine did not answer within 30 s", "engine_busy"))?
            .map_err(engine_gone)?;
        let running: Vec<&SlotState> = states.iter().filter(|s| s.running).collect();
        let fail = q.get("fail_on_no_slot").is_some_and(|v| !matches!(v.as_str(), "" | "0" | "false"));
        if fail && running.len() >= st.cfg.total_slots {
            return Err(ApiError::unavailable("no slot available", "no_slot_available"));
        }
        let n_ctx = e.info.max_model_len();
        let mut out: Vec<Value> =
            running.iter().enumerate().map(|(i, s)| slot_json(i, Some(s), n_ctx, st.cfg.speculative)).collect();
        for i in out.len()..st.cfg.total_slots {
            out.push(slot_json(i, None, n_ctx, st.cfg.speculative));
        }
        Ok(Json(Value::Array(out)).into_response())
    }
    .await;
    r.unwrap_or_else(IntoResponse::into_response)
}

/// Slot `i` as llama-server shows it: a running sequence's state, or an idle slot.
fn slot_json(i: usize, s: Option<&SlotState>, n_ctx: usize, speculative: bool) -> Value {
    let Some(s) = s else {
        return json!({
            "id": i, "id_task": -1, "n_ctx": n_ctx, "speculative": speculative, "is_processing": false,
            "next_token": {"has_next_token": false, "has_new_line": false, "n_remain": -1, "n_decoded": 0, "stopping_word": ""},
        });
    };
    json!({
        "id": i,
        "id_task": s.id,
        "n_ctx": n_ctx,
        "speculative": speculative,
        "is_processing": true,
        // Another client's sampling parameters (its seed above all) are not for this one.
        "params": {"n_predict": s.max_tokens},
        "n_prompt_tokens": s.prompt_tokens,
        "n_prompt_tokens_processed": s.prompt_processed,
        "n_prompt_tokens_cache": s.cached_tokens,
        "next_token": {
            "has_next_token": true,
            "has_new_line": false,
            "n_remain": s.max_tokens.saturating_sub(s.decoded),
            "n_decoded": s.decoded,
            "stopping_word": "",
        },
    })
}
