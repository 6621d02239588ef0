//! The wire forms of a step's parts (proto/stage.proto), both ways.

use crate::exec::proto::{self};
use crate::model::StepInput;
use crate::sampling::{Adjust, SampleParams, Sampled};

pub(super) fn tensor(shape: Vec<usize>, data: Vec<u8>) -> proto::Tensor {
    proto::Tensor { shape: shape.into_iter().map(|d| d as u64).collect(), dtype: "f32".into(), data: data.into() }
}

// The wire forms of the step's parts, both ways.

impl From<&Adjust> for proto::Adjust {
    fn from(a: &Adjust) -> Self {
        proto::Adjust { id: a.id, count: a.count, in_prompt: a.in_prompt, bias: a.bias }
    }
}

impl From<proto::Adjust> for Adjust {
    fn from(a: proto::Adjust) -> Self {
        Adjust { id: a.id, count: a.count, in_prompt: a.in_prompt, bias: a.bias }
    }
}

impl From<&SampleParams> for proto::SampleParams {
    fn from(p: &SampleParams) -> Self {
        proto::SampleParams {
            temperature: p.temperature,
            top_p: p.top_p,
            top_k: p.top_k,
            min_p: p.min_p,
            u: p.u,
            repetition_penalty: p.repetition_penalty,
            frequency_penalty: p.frequency_penalty,
            presence_penalty: p.presence_penalty,
            n_top: p.n_top,
            adjust: p.adjust.iter().map(proto::Adjust::from).collect(),
            mask: p.mask.clone().unwrap_or_default(),
            force_plus_one: p.force.map_or(0, |t| t.saturating_add(1)),
        }
    }
}

impl From<proto::SampleParams> for SampleParams {
    fn from(p: proto::SampleParams) -> Self {
        SampleParams {
            temperature: p.temperature,
            top_p: p.top_p,
            top_k: p.top_k,
            min_p: p.min_p,
            u: p.u,
            repetition_penalty: p.repetition_penalty,
            frequency_penalty: p.frequency_penalty,
            presence_penalty: p.presence_penalty,
            n_top: p.n_top,
            adjust: p.adjust.into_iter().map(Adjust::from).collect(),
            mask: (!p.mask.is_empty()).then_some(p.mask),
            force: p.force_plus_one.checked_sub(1),
        }
    }
}

impl From<Sampled> for proto::Sampled {
    fn from(r: Sampled) -> Self {
        let top = r.top.into_iter().map(|(id, logprob)| proto::TopLogprob { id, logprob }).collect();
        proto::Sampled { id: r.id, logprob: r.logprob, top }
    }
}

impl From<proto::Sampled> for Sampled {
    fn from(r: proto::Sampled) -> Self {
        Sampled { id: r.id, logprob: r.logprob, top: r.top.into_iter().map(|t| (t.id, t.logprob)).collect() }
    }
}

pub(super) fn step_request(
    s: &StepInput,
    instance: u64,
    hidden: Option<proto::Tensor>,
    want_logits: bool,
) -> proto::StepRequest {
    proto::StepRequest {
        instance,
        tokens: s.tokens.clone(),
        positions: s.positions.clone(),
        slots: s.slots.clone(),
        seq_of_token: s.seq_of_token.clone(),
        block_tables: s.block_tables.iter().map(|b| proto::BlockTable { blocks: b.clone() }).collect(),
        sample_rows: s.sample_rows.clone(),
        sampling: s.sampling.iter().map(proto::SampleParams::from).collect(),
        hidden,
        want_logits,
        session: 0,
        state_slots: s.state_slots.clone(),
    }
}

/// The step a request describes, its vectors moved out of it.
pub(super) fn step_input(r: proto::StepRequest) -> StepInput {
    StepInput {
        tokens: r.tokens,
        positions: r.positions,
        slots: r.slots,
        seq_of_token: r.seq_of_token,
        block_tables: r.block_tables.into_iter().map(|b| b.blocks).collect(),
        sample_rows: r.sample_rows,
        sampling: r.sampling.into_iter().map(SampleParams::from).collect(),
        state_slots: r.state_slots,
    }
}

#[cfg(test)]
mod tests {
    use crate::exec::proto;
    use crate::sampling::{Adjust, SampleParams};

    /// The sampling parameters cross the wire whole, token mask included (and no mask stays none).
    #[test]
    fn sample_params_round_trip_with_and_without_a_mask() {
        let with = SampleParams {
            temperature: 0.7,
            top_k: 5,
            adjust: vec![Adjust { id: 3, count: 1, in_prompt: true, bias: -1.0 }],
            mask: Some(vec![0b1011, 0, u32::MAX]),
            force: Some(0),
            ..Default::default()
        };
        for p in [with, SampleParams::default()] {
            let wire = proto::SampleParams::from(&p);
            assert_eq!(SampleParams::from(wire), p);
        }
    }
}
