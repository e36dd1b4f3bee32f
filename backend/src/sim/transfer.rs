//! The simulator's KV transport: the real TCP transport and protocol (a
//! simulated block carries no bytes), behind a delay for what the blocks
//! would weigh: each chunk is held until a link of the profile's bandwidth
//! would have carried `blocks * block_size * kv_bytes_per_token` bytes, one
//! chunk after another.

use std::time::Duration;

use futures_util::future::BoxFuture;
use tokio::time::Instant;

use crate::transfer::tcp::TcpTransport;
use crate::transfer::{KvExport, KvLayout, KvTarget, KvTransport, Pushed, TransferError};

#[derive(Clone, Copy, Debug)]
pub struct SimTransport {
    pub inner: TcpTransport,
    /// Modelled bytes of one block.
    pub block_bytes: f64,
    /// The modelled link, bytes per second.
    pub link_bytes_s: f64,
    /// Real seconds per modelled second.
    pub time_scale: f64,
}

impl SimTransport {
    /// Real time the link takes for `blocks` blocks.
    pub fn delay(&self, blocks: u32) -> Duration {
        if self.link_bytes_s <= 0.0 {
            return Duration::ZERO;
        }
        Duration::from_secs_f64(
            f64::from(blocks) * self.block_bytes / self.link_bytes_s * self.time_scale,
        )
    }
}

impl KvTransport for SimTransport {
    fn push(
        &self,
        target: KvTarget,
        layout: KvLayout,
        mut chunks: tokio::sync::mpsc::UnboundedReceiver<KvExport>,
    ) -> BoxFuture<'static, Result<Pushed, TransferError>> {
        let (tx, delayed) = tokio::sync::mpsc::unbounded_channel();
        let this = *self;
        // Ends when the engine's export ends, or when the push is dropped
        // (the send then fails).
        tokio::spawn(async move {
            let mut link_free = Instant::now();
            while let Some(chunk) = chunks.recv().await {
                link_free = link_free.max(Instant::now()) + this.delay(chunk.n_blocks);
                tokio::time::sleep_until(link_free).await;
                if tx.send(chunk).is_err() {
                    return;
                }
            }
        });
        self.inner.push(target, layout, delayed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_takes_its_bytes_over_the_link() {
        let t = SimTransport {
            inner: TcpTransport::default(),
            block_bytes: 16.0 * 131_072.0,
            link_bytes_s: 50e9,
            time_scale: 2.0,
        };
        // 2 MiB at 50 GB/s is 41.9 µs, twice that at time scale 2.
        let d = t.delay(1).as_secs_f64();
        assert!((d - 2.0 * 16.0 * 131_072.0 / 50e9).abs() < 1e-9, "{d}");
        let ten = t.delay(10).as_secs_f64();
        assert!((ten - 10.0 * d).abs() < 1e-9, "{ten} vs 10 x {d}");
        let free = SimTransport {
            link_bytes_s: 0.0,
            ..t
        };
        assert_eq!(free.delay(1000), Duration::ZERO);
    }
}
