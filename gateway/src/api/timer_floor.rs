//! One timer kept pending on a busy server thread, so that the timers each
//! request sets (its deadline, the worker's idle timeout) do not each wake
//! the thread's own event loop.
//!
//! tokio's timer driver remembers, when its thread parks, the earliest timer
//! it waits for; a timer set earlier than that (or any timer, when the thread
//! parked with none) makes it write to the runtime's eventfd so that a parked
//! thread would recompute its wait. It does so even when the thread setting
//! the timer is the runtime's own, running. A server thread between two
//! requests parks with no timer at all, so every request's first timer cost a
//! `write` and one more `epoll_wait` return. While requests keep coming, a
//! task here keeps a timer at most [`FLOOR`] ahead: request timers further
//! out than that set no wake-up. After a [`FLOOR`] with no request, the task
//! ends, and an idle thread has no timer to wake for.

use std::cell::Cell;
use std::time::Duration;

/// How far ahead the kept timer lies; request timers nearer than this still
/// wake the loop (the defaults are 60 s and 600 s).
pub const FLOOR: Duration = Duration::from_secs(1);

thread_local! {
    /// Requests this thread has taken.
    static REQUESTS: Cell<u64> = const { Cell::new(0) };
    /// Whether this thread's floor task runs.
    static ARMED: Cell<bool> = const { Cell::new(false) };
}

/// Counts a request on this thread, and starts the thread's floor task if
/// it does not run. Call inside the thread's runtime.
pub fn request_arrived() {
    REQUESTS.set(REQUESTS.get().wrapping_add(1));
    if !ARMED.replace(true) {
        tokio::spawn(keep_floor());
    }
}

/// Whether this thread's floor task runs.
#[cfg(test)]
fn armed() -> bool {
    ARMED.get()
}

/// Sleeps a [`FLOOR`] at a time for as long as requests came in the last one.
async fn keep_floor() {
    loop {
        let seen = REQUESTS.get();
        tokio::time::sleep(FLOOR).await;
        if REQUESTS.get() == seen {
            ARMED.set(false);
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The task runs while requests come and ends a floor after the last.
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn the_floor_task_lasts_while_requests_come_and_ends_after() {
        assert!(!armed());
        request_arrived();
        assert!(armed());
        for _ in 0..5 {
            tokio::time::sleep(FLOOR / 2).await;
            request_arrived();
            assert!(armed());
        }
        // One floor without a request: still waiting out its sleep.
        tokio::time::sleep(FLOOR + FLOOR / 4).await;
        assert!(armed());
        // Another: it has seen none and ended.
        tokio::time::sleep(FLOOR).await;
        assert!(!armed());
        // And starts again with the next request.
        request_arrived();
        assert!(armed());
    }
}
