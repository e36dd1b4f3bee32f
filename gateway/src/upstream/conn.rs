//! The request path's HTTP/1 connections to sluice workers, through hyper's
//! client connection directly (no reqwest layer: its pool, request builder
//! and body stream cost work on every request). Each server thread keeps its
//! own idle connections per worker address (the threads run current-thread
//! runtimes, so a connection's driver task lives where it is used). A
//! connection goes back to its thread's pool once an answer's body has been
//! read to its end, or *released* after its last event (`Answer::release`);
//! an answer dropped before that closes its connection, which is how a worker
//! learns that a request was abandoned. A pooled connection
//! the worker has closed meanwhile is retried once on a fresh one.

use std::cell::RefCell;
use std::collections::HashMap;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::{Body, Incoming};
use hyper::client::conn::http1::{self, SendRequest};
use hyper::header::{CONTENT_TYPE, HOST, HeaderValue};
use hyper::{Request, StatusCode};
use hyper_util::rt::TokioIo;

type Sender = SendRequest<Full<Bytes>>;

/// Idle connections kept per worker address and thread.
const IDLE_PER_WORKER: usize = 64;

/// How long [`Answer::release`] waits for a body's end after its last event.
const RELEASE_WAIT: Duration = Duration::from_secs(1);

/// How much [`Answer::release`] reads past the last event before giving up on
/// a connection.
const RELEASE_LIMIT: usize = 64 << 10;

thread_local! {
    static IDLE: RefCell<HashMap<String, Vec<Sender>>> = RefCell::new(HashMap::new());
}

#[derive(Debug, thiserror::Error)]
pub enum ConnError {
    #[error("not an http:// URL: {0}")]
    Url(String),
    #[error("cannot connect: {0}")]
    Connect(#[source] std::io::Error),
    #[error("cannot connect within {0:?}")]
    ConnectTimeout(Duration),
    #[error("{0}")]
    Http(#[from] hyper::Error),
    #[error("bad header value")]
    Header,
}

/// A worker's base URL (`http://host:port`, perhaps with a path prefix) as
/// the address to connect to (also the `Host` header) and the prefix of the
/// paths to ask for.
pub fn split_url(base_url: &str) -> Result<(&str, &str), ConnError> {
    let rest = base_url
        .strip_prefix("http://")
        .ok_or_else(|| ConnError::Url(base_url.to_string()))?;
    let rest = rest.trim_end_matches('/');
    let (authority, prefix) = match rest.find('/') {
        Some(i) => rest.split_at(i),
        None => (rest, ""),
    };
    if authority.is_empty() {
        return Err(ConnError::Url(base_url.to_string()));
    }
    Ok((authority, prefix))
}

/// A worker's answer: its status, then its body a chunk at a time.
pub struct Answer {
    status: StatusCode,
    body: Incoming,
    /// The connection, back to the pool at the body's end.
    sender: Option<(String, Sender)>,
    /// Whether the request needed a new connection (none idle was usable).
    new_connection: bool,
}

impl std::fmt::Debug for Answer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Answer")
            .field("status", &self.status)
            .finish_non_exhaustive()
    }
}

impl Answer {
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// Whether this request opened a new connection to the worker.
    pub fn new_connection(&self) -> bool {
        self.new_connection
    }

    /// The body's next bytes; `None` at its end (the connection then goes
    /// back to this thread's pool).
    pub async fn chunk(&mut self) -> Option<Result<Bytes, hyper::Error>> {
        loop {
            match self.body.frame().await {
                None => {
                    self.finished();
                    return None;
                }
                Some(Err(e)) => {
                    self.sender = None;
                    return Some(Err(e));
                }
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        return Some(Ok(data));
                    }
                    // Trailers: nothing a worker sends; read on.
                }
            }
        }
    }

    /// The whole body, up to `limit` bytes (an error past it).
    pub async fn bytes(mut self, limit: usize) -> Result<Vec<u8>, String> {
        let mut out = Vec::new();
        while let Some(chunk) = self.chunk().await {
            out.extend_from_slice(&chunk.map_err(|e| e.to_string())?);
            if out.len() > limit {
                return Err(format!("answer over {limit} bytes"));
            }
        }
        Ok(out)
    }

    /// The worker has sent everything it will (its last event came): what
    /// follows is the body's end. The connection goes back to this thread's
    /// pool once that end is read: now, when it came with the last event,
    /// else from a task that waits for it (at most [`RELEASE_WAIT`], reading
    /// at most [`RELEASE_LIMIT`] bytes) and closes the connection if it does
    /// not come. Dropping the answer instead would close a connection that
    /// could serve the next request, and cost a new TCP connection each time.
    pub fn release(mut self) {
        let mut cx = Context::from_waker(Waker::noop());
        match Pin::new(&mut self.body).poll_frame(&mut cx) {
            Poll::Ready(None) => self.finished(),
            // A broken connection: dropped, so closed.
            Poll::Ready(Some(Err(_))) => {}
            Poll::Ready(Some(Ok(_))) | Poll::Pending => {
                tokio::spawn(async move {
                    let drained = tokio::time::timeout(RELEASE_WAIT, self.bytes(RELEASE_LIMIT));
                    if let Ok(Err(why)) = drained.await {
                        tracing::debug!(error = %why, "worker answer went on after its last event");
                    }
                });
            }
        }
    }

    fn finished(&mut self) {
        if let Some((key, sender)) = self.sender.take() {
            put_idle(key, sender);
        }
    }
}

/// POSTs a JSON `body` to `path` of the worker at `authority` (see
/// [`split_url`]) with `traceparent`, on an idle connection of this thread or
/// a new one (connecting within `connect_timeout`).
pub async fn post_json(
    authority: &str,
    path: &str,
    traceparent: &str,
    body: Bytes,
    connect_timeout: Duration,
) -> Result<Answer, ConnError> {
    let traceparent = HeaderValue::from_str(traceparent).map_err(|_| ConnError::Header)?;
    let request = |body: Bytes| {
        Request::post(path)
            .header(HOST, authority)
            .header(CONTENT_TYPE, "application/json")
            .header("traceparent", traceparent.clone())
            .body(Full::new(body))
            .map_err(|_| ConnError::Header)
    };
    // A pooled connection may have been closed by the worker since; its
    // request then fails before any answer, and goes once more on a new one.
    if let Some(mut sender) = take_idle(authority)
        && sender.ready().await.is_ok()
    {
        match sender.send_request(request(body.clone())?).await {
            Ok(response) => return Ok(answer(authority, sender, response, false)),
            Err(e) if e.is_canceled() || e.is_closed() || e.is_incomplete_message() => {}
            Err(e) => return Err(e.into()),
        }
    }
    let mut sender = connect(authority, connect_timeout).await?;
    sender.ready().await?;
    let response = sender.send_request(request(body)?).await?;
    Ok(answer(authority, sender, response, true))
}

fn answer(
    authority: &str,
    sender: Sender,
    response: hyper::Response<Incoming>,
    new_connection: bool,
) -> Answer {
    let (parts, body) = response.into_parts();
    Answer {
        status: parts.status,
        body,
        sender: Some((authority.to_string(), sender)),
        new_connection,
    }
}

async fn connect(authority: &str, limit: Duration) -> Result<Sender, ConnError> {
    let stream = tokio::time::timeout(limit, tokio::net::TcpStream::connect(authority))
        .await
        .map_err(|_| ConnError::ConnectTimeout(limit))?
        .map_err(ConnError::Connect)?;
    stream.set_nodelay(true).map_err(ConnError::Connect)?;
    let (sender, connection) = http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::debug!(error = %e, "worker connection ended");
        }
    });
    Ok(sender)
}

fn take_idle(authority: &str) -> Option<Sender> {
    IDLE.with(|idle| {
        let mut idle = idle.borrow_mut();
        let senders = idle.get_mut(authority)?;
        while let Some(sender) = senders.pop() {
            if !sender.is_closed() {
                return Some(sender);
            }
        }
        None
    })
}

fn put_idle(authority: String, sender: Sender) {
    if sender.is_closed() {
        return;
    }
    IDLE.with(|idle| {
        let mut idle = idle.borrow_mut();
        let senders = idle.entry(authority).or_default();
        senders.retain(|s| !s.is_closed());
        if senders.len() < IDLE_PER_WORKER {
            senders.push(sender);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// Listens on a free port and serves each connection with `serve`;
    /// returns the address and the count of connections accepted.
    async fn counting_server<F, Fut>(serve: F) -> (String, Arc<AtomicUsize>)
    where
        F: Fn(tokio::net::TcpStream) -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let accepted = Arc::new(AtomicUsize::new(0));
        let count = accepted.clone();
        tokio::spawn(async move {
            loop {
                let (socket, _) = listener.accept().await.unwrap();
                count.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(serve(socket));
            }
        });
        (addr, accepted)
    }

    /// A server answering each request on a connection with `body`, counting
    /// the connections it accepted; with `close_after_one`, it closes every
    /// connection after its first answer (as a worker restarting would).
    async fn server(body: &'static str, close_after_one: bool) -> (String, Arc<AtomicUsize>) {
        counting_server(move |mut socket| async move {
            let mut buf = vec![0u8; 4096];
            loop {
                // A request: headers then a body of Content-Length bytes.
                let mut got = Vec::new();
                let head_end = loop {
                    let n = match socket.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => n,
                    };
                    got.extend_from_slice(&buf[..n]);
                    if let Some(i) = got.windows(4).position(|w| w == b"\r\n\r\n") {
                        break i + 4;
                    }
                };
                let head = String::from_utf8_lossy(&got[..head_end]).to_lowercase();
                let length: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .map_or(0, |v| v.trim().parse().unwrap());
                while got.len() < head_end + length {
                    let n = socket.read(&mut buf).await.unwrap();
                    got.extend_from_slice(&buf[..n]);
                }
                let answer = format!(
                    "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{body}",
                    body.len()
                );
                socket.write_all(answer.as_bytes()).await.unwrap();
                if close_after_one {
                    return;
                }
            }
        })
        .await
    }

    /// A request to the test server, which must be answered.
    async fn ask(addr: &str) -> Answer {
        post_json(
            addr,
            "/x",
            "00-a-b-01",
            Bytes::from_static(b"{}"),
            Duration::from_secs(1),
        )
        .await
        .unwrap()
    }

    #[test]
    fn urls_split_into_address_and_path_prefix_and_others_are_refused() {
        assert_eq!(
            split_url("http://127.0.0.1:8081").unwrap(),
            ("127.0.0.1:8081", "")
        );
        assert_eq!(split_url("http://w1:80/").unwrap(), ("w1:80", ""));
        assert_eq!(
            split_url("http://w1:80/pool/a/").unwrap(),
            ("w1:80", "/pool/a")
        );
        assert!(split_url("https://w1:80").is_err());
        assert!(split_url("http://").is_err());
        assert!(split_url("http:///x").is_err());
    }

    #[tokio::test(flavor = "current_thread")]
    async fn answers_read_to_the_end_leave_their_connection_for_the_next_request() {
        let (addr, accepted) = server("{\"ok\":1}", false).await;
        for _ in 0..3 {
            let answer = ask(&addr).await;
            assert_eq!(answer.status(), StatusCode::OK);
            assert_eq!(answer.bytes(1 << 10).await.unwrap(), b"{\"ok\":1}");
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
        // An answer dropped unread closes its connection: the next one is new.
        let answer = ask(&addr).await;
        drop(answer);
        let answer = ask(&addr).await;
        assert_eq!(answer.bytes(1 << 10).await.unwrap(), b"{\"ok\":1}");
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
    }

    /// A server answering each request with a chunked body: `event`, then
    /// the body's end (in the same write with `end_after` zero, else that
    /// long after); counts the connections it accepted.
    async fn chunked_server(
        event: &'static str,
        end_after: Duration,
    ) -> (String, Arc<AtomicUsize>) {
        counting_server(move |mut socket| async move {
            let mut buf = vec![0u8; 4096];
            loop {
                // Requests here are small: one read holds one.
                match socket.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
                let head = format!(
                    "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n{:x}\r\n{event}\r\n",
                    event.len()
                );
                if end_after.is_zero() {
                    let whole = format!("{head}0\r\n\r\n");
                    socket.write_all(whole.as_bytes()).await.unwrap();
                    continue;
                }
                socket.write_all(head.as_bytes()).await.unwrap();
                tokio::time::sleep(end_after).await;
                socket.write_all(b"0\r\n\r\n").await.unwrap();
            }
        })
        .await
    }

    /// Reads an answer's first chunk (the whole event), then releases it.
    async fn ask_and_release(addr: &str) {
        let mut answer = ask(addr).await;
        let chunk = answer.chunk().await.unwrap().unwrap();
        assert_eq!(&chunk[..], b"{\"event\":\"finished\"}\n");
        answer.release();
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_released_answer_leaves_its_connection_for_the_next_request() {
        // The end comes with the last event, or 50 ms after it (read by a
        // task then).
        for end_after in [Duration::ZERO, Duration::from_millis(50)] {
            let (addr, accepted) = chunked_server("{\"event\":\"finished\"}\n", end_after).await;
            for _ in 0..3 {
                ask_and_release(&addr).await;
                // Time for the end to come and the connection to go back.
                tokio::time::sleep(end_after * 2 + Duration::from_millis(10)).await;
            }
            assert_eq!(
                accepted.load(Ordering::SeqCst),
                1,
                "end after {end_after:?}"
            );
        }
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_released_answer_whose_end_never_comes_closes_its_connection() {
        let (addr, accepted) = chunked_server("{\"event\":\"finished\"}\n", RELEASE_WAIT * 3).await;
        ask_and_release(&addr).await;
        tokio::time::sleep(RELEASE_WAIT + Duration::from_millis(200)).await;
        // Not back in the pool: the next request needs a new connection,
        // and gets its answer.
        ask_and_release(&addr).await;
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_pooled_connection_the_worker_closed_is_retried_on_a_new_one() {
        let (addr, accepted) = server("done", true).await;
        for round in 1..=3 {
            let answer = ask(&addr).await;
            assert_eq!(answer.bytes(1 << 10).await.unwrap(), b"done");
            // Let the server's close reach the pooled connection (or not:
            // either way the next request must succeed).
            if round == 2 {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 3);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_worker_that_is_not_listening_is_an_error_not_a_hang() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        drop(listener);
        let err = post_json(
            &addr,
            "/x",
            "00-a-b-01",
            Bytes::new(),
            Duration::from_secs(1),
        )
        .await
        .err()
        .unwrap();
        assert!(matches!(err, ConnError::Connect(_)), "{err}");
    }
}
