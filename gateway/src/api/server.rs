//! The HTTP server's threads: one current-thread tokio runtime per thread,
//! each accepting on its own `SO_REUSEPORT` listener of the same address, so
//! a request is read, preprocessed, relayed and answered on one thread (the
//! kernel spreads connections over the threads; only the admission queue and
//! the shared fleet state are touched across threads). Each thread has its
//! own connections to the workers: to sluice workers through
//! `upstream::conn`'s pool, to OpenAI workers through a reqwest client.

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::sync::watch;

use crate::gateway::Gateway;

thread_local! {
    /// This thread's client to OpenAI workers (see `Gateway::client`).
    static CLIENT: std::cell::OnceCell<reqwest::Client> = const { std::cell::OnceCell::new() };
}

/// The calling thread's HTTP client to workers, built on first use with
/// `make`; every server thread has its own, so its pooled connections live on
/// its own runtime.
pub fn thread_client(make: impl FnOnce() -> reqwest::Client) -> reqwest::Client {
    CLIENT.with(|c| c.get_or_init(make).clone())
}

/// Running server threads; dropping it (or [`ServerThreads::shutdown`]) stops
/// them accepting and lets open connections finish.
#[derive(Debug)]
pub struct ServerThreads {
    pub addr: SocketAddr,
    stop: watch::Sender<bool>,
    threads: Vec<std::thread::JoinHandle<std::io::Result<()>>>,
}

impl ServerThreads {
    pub fn shutdown(&mut self) {
        let _ = self.stop.send(true);
    }

    /// Waits (blocking) until every thread has stopped; the first error wins.
    pub fn join(mut self) -> std::io::Result<()> {
        let mut result = Ok(());
        for t in self.threads.drain(..) {
            let r = t
                .join()
                .unwrap_or_else(|_| Err(std::io::Error::other("a server thread panicked")));
            if result.is_ok() {
                result = r;
            }
        }
        result
    }
}

impl Drop for ServerThreads {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Binds `addr` with `SO_REUSEPORT` (inside the calling thread's runtime).
fn bind(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.set_reuseport(true)?;
    socket.bind(addr)?;
    socket.listen(1024)
}

/// Starts `threads` server threads on `addr` (port 0 picks one for all).
pub fn start(
    addr: SocketAddr,
    threads: usize,
    gateway: Arc<Gateway>,
) -> std::io::Result<ServerThreads> {
    // A plain bind first: if another process already serves this address
    // (with SO_REUSEPORT it would silently share it), fail now.
    let addr = std::net::TcpListener::bind(addr)?.local_addr()?;
    let (stop, stopped) = watch::channel(false);
    let (bound_tx, bound_rx) = std::sync::mpsc::channel::<std::io::Result<SocketAddr>>();
    let mut handles = Vec::new();
    for i in 0..threads.max(1) {
        let (gateway, mut stopped, bound_tx) = (gateway.clone(), stopped.clone(), bound_tx.clone());
        let handle = std::thread::Builder::new()
            .name(format!("sluice-http-{i}"))
            .spawn(move || -> std::io::Result<()> {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()?;
                runtime.block_on(async move {
                    let listener = match bind(addr).and_then(|l| Ok((l.local_addr()?, l))) {
                        Ok((local, l)) => {
                            let _ = bound_tx.send(Ok(local));
                            l
                        }
                        Err(e) => {
                            let _ =
                                bound_tx.send(Err(std::io::Error::new(e.kind(), e.to_string())));
                            return Err(e);
                        }
                    };
                    let shutdown = async move {
                        let _ = stopped.wait_for(|s| *s).await;
                    };
                    super::serve_on(listener, gateway, shutdown).await
                })
            })?;
        handles.push(handle);
        bound_rx
            .recv()
            .map_err(|_| std::io::Error::other("a server thread stopped before binding"))??;
    }
    Ok(ServerThreads {
        addr,
        stop,
        threads: handles,
    })
}
