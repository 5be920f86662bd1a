//! # stoke-serve
//!
//! An OpenAI-compatible HTTP server on [`stoke_engine`]: `POST /v1/completions` and
//! `POST /v1/chat/completions` (whole responses or server-sent events), `GET /v1/models`,
//! `POST /tokenize`, `POST /detokenize`, `GET /health` and `GET /metrics` (Prometheus).
//!
//! The engine runs on a thread of its own ([`worker`]); handlers ([`server`]) parse and check a
//! request ([`api`]), render chat messages through the model's template ([`chat`]), tokenize,
//! and submit each choice to the engine's thread with a channel for its tokens. A client that
//! goes away closes that channel, and the engine aborts the request and frees its pages.
//! [`loadgen`] is the open-loop load generator the `stoke-load` binary runs.

pub mod api;
pub mod chat;
pub mod loadgen;
pub mod metrics;
pub mod server;
pub mod worker;

use axum::serve::ListenerExt;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// Serves `state` on `listener` until SIGTERM or Ctrl-C. Then new requests get 503, the
/// requests in flight get `grace` to finish, the rest are ended (their responses say so), and
/// this returns once every connection has closed.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<server::AppState>,
    grace: Duration,
) -> std::io::Result<()> {
    let app = server::router(state.clone());
    let shutdown = async move {
        stop_signal().await;
        tracing::info!(
            "stoke serve: stopping: new requests get 503; {} s for those in flight",
            grace.as_secs()
        );
        state.draining.store(true, Ordering::Relaxed);
        let worker = state.worker.clone();
        tokio::spawn(async move {
            tokio::time::sleep(grace).await;
            worker.abort_all();
        });
    };
    // Each streamed token is a small write: without TCP_NODELAY, Nagle's algorithm holds one
    // until the client acknowledges the previous (a delayed ACK: tens of milliseconds).
    let listener = listener.tap_io(|tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::warn!("stoke serve: TCP_NODELAY not set on a connection: {e}");
        }
    });
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
}

async fn stop_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = ctrl_c => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = ctrl_c.await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}
