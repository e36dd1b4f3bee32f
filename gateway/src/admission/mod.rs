//! The admission stage: asks the admission policy (plugin or built-in) about
//! each request, and holds queued requests in a priority queue until the
//! fleet has room. A [`Ticket`] is a request's place among the running ones;
//! dropping it makes room for the next queued request.

use std::collections::BinaryHeap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tokio::sync::oneshot;

/// Why a request did not get in.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QueueError {
    #[error("the admission queue is full ({0} requests waiting)")]
    Full(u32),
    #[error("the request waited in the admission queue until its deadline")]
    TimedOut,
}

#[derive(Debug)]
struct Waiter {
    priority: i32,
    /// Arrival order: earlier leaves first among equal priorities.
    seq: u64,
    wake: oneshot::Sender<()>,
}

impl PartialEq for Waiter {
    fn eq(&self, other: &Self) -> bool {
        (self.priority, self.seq) == (other.priority, other.seq)
    }
}
impl Eq for Waiter {}
impl PartialOrd for Waiter {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Waiter {
    /// Higher priority first, then earlier arrival.
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.priority
            .cmp(&other.priority)
            .then(other.seq.cmp(&self.seq))
    }
}

#[derive(Debug, Default)]
struct State {
    running: u32,
    capacity: u32,
    waiting: BinaryHeap<Waiter>,
    next_seq: u64,
}

impl State {
    /// Wakes waiters while there is room.
    fn release_waiters(&mut self) {
        while self.running < self.capacity {
            let Some(w) = self.waiting.pop() else { return };
            // A waiter that gave up has dropped its receiver.
            if w.wake.send(()).is_ok() {
                self.running += 1;
            }
        }
    }
}

/// Running requests and the queue of waiting ones.
#[derive(Debug)]
pub struct AdmissionQueue {
    state: Mutex<State>,
    max_queued: u32,
}

/// A running request's place; dropping it frees the place.
#[derive(Debug)]
pub struct Ticket {
    queue: Arc<AdmissionQueue>,
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut s = self.queue.lock();
        s.running = s.running.saturating_sub(1);
        s.release_waiters();
    }
}

impl AdmissionQueue {
    pub fn new(max_queued: u32) -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new(State::default()),
            max_queued,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Sets how many requests may run at once (it follows the fleet's size).
    pub fn set_capacity(&self, capacity: u32) {
        let mut s = self.lock();
        s.capacity = capacity;
        s.release_waiters();
    }

    pub fn waiting(&self) -> u32 {
        self.lock().waiting.len() as u32
    }

    pub fn running(&self) -> u32 {
        self.lock().running
    }

    /// Runs now, whatever the capacity (the policy admitted it).
    pub fn admit(self: &Arc<Self>) -> Ticket {
        self.lock().running += 1;
        Ticket {
            queue: self.clone(),
        }
    }

    /// Runs when there is room and no one of higher priority is waiting;
    /// waits at most until `deadline`.
    pub async fn enqueue(
        self: &Arc<Self>,
        priority: i32,
        deadline: Instant,
    ) -> Result<Ticket, QueueError> {
        let (rx, seq) = {
            let mut s = self.lock();
            if s.waiting.is_empty() && s.running < s.capacity {
                s.running += 1;
                return Ok(Ticket {
                    queue: self.clone(),
                });
            }
            if s.waiting.len() as u32 >= self.max_queued {
                return Err(QueueError::Full(s.waiting.len() as u32));
            }
            let (wake, rx) = oneshot::channel();
            let seq = s.next_seq;
            s.next_seq += 1;
            s.waiting.push(Waiter {
                priority,
                seq,
                wake,
            });
            (rx, seq)
        };
        let mut wait = Wait {
            queue: self,
            seq,
            rx,
            woken: false,
        };
        match tokio::time::timeout_at(deadline.into(), &mut wait.rx).await {
            Ok(Ok(())) => {
                wait.woken = true;
                Ok(Ticket {
                    queue: self.clone(),
                })
            }
            // Timed out (or the queue went away): `wait`'s drop leaves the queue.
            _ => Err(QueueError::TimedOut),
        }
    }
}

/// A place in the queue; leaving it (timeout, or the request dropped) takes
/// the waiter out, and gives back a place that was granted too late.
struct Wait<'a> {
    queue: &'a AdmissionQueue,
    seq: u64,
    rx: oneshot::Receiver<()>,
    woken: bool,
}

impl Drop for Wait<'_> {
    fn drop(&mut self) {
        if self.woken {
            return;
        }
        self.rx.close();
        let granted = self.rx.try_recv().is_ok();
        let mut s = self.queue.lock();
        let seq = self.seq;
        s.waiting.retain(|w| w.seq != seq);
        if granted {
            s.running = s.running.saturating_sub(1);
            s.release_waiters();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn queued_requests_leave_by_priority_then_arrival() {
        let queue = AdmissionQueue::new(10);
        queue.set_capacity(1);
        let deadline = Instant::now() + Duration::from_secs(3600);
        let first = queue.enqueue(0, deadline).await.unwrap();
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for (name, priority) in [("low", 0), ("high", 5), ("low2", 0), ("mid", 2)] {
            let (queue, order) = (queue.clone(), order.clone());
            tasks.push(tokio::spawn(async move {
                let t = queue.enqueue(priority, deadline).await.unwrap();
                order.lock().unwrap().push(name);
                tokio::time::sleep(Duration::from_millis(1)).await;
                drop(t);
            }));
            tokio::task::yield_now().await;
        }
        assert_eq!(queue.waiting(), 4);
        drop(first);
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(*order.lock().unwrap(), ["high", "mid", "low", "low2"]);
        assert_eq!(queue.running(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_full_queue_refuses_and_a_deadline_ends_the_wait() {
        let queue = AdmissionQueue::new(1);
        queue.set_capacity(0);
        let soon = Instant::now() + Duration::from_millis(50);
        let q = queue.clone();
        let waiting = tokio::spawn(async move { q.enqueue(0, soon).await.map(drop) });
        tokio::task::yield_now().await;
        assert_eq!(
            queue.enqueue(0, soon).await.map(drop),
            Err(QueueError::Full(1))
        );
        assert_eq!(waiting.await.unwrap(), Err(QueueError::TimedOut));
        // Admitted requests run whatever the capacity; growing it wakes waiters.
        let admitted = queue.admit();
        assert_eq!(queue.running(), 1);
        drop(admitted);
        let q = queue.clone();
        let later = Instant::now() + Duration::from_secs(1);
        let waiting = tokio::spawn(async move { q.enqueue(0, later).await.map(drop) });
        tokio::task::yield_now().await;
        queue.set_capacity(1);
        assert_eq!(waiting.await.unwrap(), Ok(()));
        assert_eq!(queue.running(), 0);
    }
}
