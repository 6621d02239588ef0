//! Process shutdown on SIGINT or SIGTERM, shared by `serve` and `worker`.
//!
//! Owns: the SIGINT/SIGTERM future shared by serve and worker.
//! May use: nothing.
//! Never uses: every other room.

/// Resolves when SIGINT or SIGTERM arrives.
pub async fn signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {}
        _ = term => {}
    }
}
