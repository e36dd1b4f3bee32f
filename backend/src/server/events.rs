//! A worker's `/events` stream (SSE): its KV events with their sequence
//! numbers, batched under load, and a load report every 250 ms. A gateway
//! wakes up for every write it receives on this stream, so a busy worker
//! sends its KV events in batches: the first after a quiet spell at once,
//! then at most one write per [`KV_EVENTS_WINDOW`].

use std::convert::Infallible;
use std::time::Duration;

use axum::response::sse::{Event, KeepAlive, Sse};
use futures_util::FutureExt;
use tokio::sync::broadcast;
use tokio::time::Instant;
use tokio_stream::wrappers::errors::BroadcastStreamRecvError;
use tokio_stream::wrappers::{BroadcastStream, IntervalStream};
use tokio_stream::{Stream, StreamExt};

use crate::engine::{Load, NumberedKvEvent};

/// Under a steady flow of KV events, one write of them at most this often:
/// how stale a gateway's KV index may be under load.
pub const KV_EVENTS_WINDOW: Duration = Duration::from_millis(50);

/// How often the stream carries a load report (and so a gateway's
/// heartbeat).
pub const LOAD_INTERVAL: Duration = Duration::from_millis(250);

/// `/events` from a subscription to the engine's KV events and its load. A
/// `lagged` event says events were dropped for this listener (the gateway
/// then resyncs from `/internal/kv`).
pub fn event_stream(
    kv: broadcast::Receiver<NumberedKvEvent>,
    load: impl Fn() -> Load + Send + 'static,
) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    let kv = futures_util::StreamExt::flat_map(
        batched(BroadcastStream::new(kv), KV_EVENTS_WINDOW),
        tokio_stream::iter,
    )
    .map(|e| match e {
        Ok(e) => Event::default()
            .event("kv")
            .json_data(e)
            .unwrap_or_default(),
        Err(BroadcastStreamRecvError::Lagged(n)) => {
            Event::default().event("lagged").data(n.to_string())
        }
    });
    let load = IntervalStream::new(tokio::time::interval(LOAD_INTERVAL)).map(move |_| {
        Event::default()
            .event("load")
            .json_data(load())
            .unwrap_or_default()
    });
    Sse::new(kv.merge(load).map(Ok)).keep_alive(KeepAlive::default())
}

/// The items of `stream` in batches: an item that comes more than `window`
/// after the previous batch goes out at once (with whatever is ready beside
/// it); one that comes sooner waits until `window` after the previous batch
/// and goes out with everything that arrived meanwhile.
pub fn batched<S: Stream + Unpin>(stream: S, window: Duration) -> impl Stream<Item = Vec<S::Item>> {
    futures_util::stream::unfold(
        (stream, None::<Instant>),
        move |(mut stream, last)| async move {
            let mut batch = vec![stream.next().await?];
            if let Some(due) = last.map(|t| t + window) {
                tokio::time::sleep_until(due).await;
            }
            while let Some(Some(item)) = stream.next().now_or_never() {
                batch.push(item);
            }
            Some((batch, (stream, Some(Instant::now()))))
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Items sent at these milliseconds come out in these batches, at these
    /// milliseconds (tokio's clock, paused: exact).
    #[tokio::test(start_paused = true)]
    async fn a_steady_flow_comes_in_batches_and_a_lone_item_at_once() {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let start = Instant::now();
        tokio::spawn(async move {
            for (at_ms, item) in [(0, 1), (10, 2), (20, 3), (200, 4), (210, 5)] {
                tokio::time::sleep_until(start + Duration::from_millis(at_ms)).await;
                tx.send(item).unwrap();
            }
        });
        let window = Duration::from_millis(50);
        let batches: Vec<(u128, Vec<i32>)> = batched(
            tokio_stream::wrappers::UnboundedReceiverStream::new(rx),
            window,
        )
        .map(|b| (start.elapsed().as_millis(), b))
        .collect()
        .await;
        assert_eq!(
            batches,
            [
                (0, vec![1]),
                // 2 and 3 wait for the window after the first batch.
                (50, vec![2, 3]),
                // Quiet since 50: 4 goes at once, 5 waits for its window.
                (200, vec![4]),
                (250, vec![5]),
            ]
        );
    }
}
