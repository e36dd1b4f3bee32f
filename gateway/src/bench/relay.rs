//! The floor of `sluice bench gateway`: a process that only relays bytes
//! between each client connection and a connection of its own to the
//! upstream (no HTTP parsing, no routing, one upstream). Any gateway that is a
//! second process between client and upstream pays what this one does, two
//! more trips over loopback TCP and the wake-ups that deliver them, so its
//! added latency is the least a gateway can add on the machine the benchmark
//! runs on, and its CPU per request the least a process moving the bytes
//! spends in the kernel.

use std::net::SocketAddr;

use tokio::net::{TcpListener, TcpStream};

/// Relays every connection accepted on `listen` to `upstream`, on one
/// current-thread runtime (as each of `sluice serve`'s server threads), until
/// the process ends.
pub fn run(listen: SocketAddr, upstream: SocketAddr) -> std::io::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()?;
    runtime.block_on(async move { serve(TcpListener::bind(listen).await?, upstream).await })
}

/// Accepts connections on `listener` and relays each to a connection of its
/// own to `upstream`; a connection that fails ends alone.
async fn serve(listener: TcpListener, upstream: SocketAddr) -> std::io::Result<()> {
    loop {
        let (mut client, _) = listener.accept().await?;
        tokio::spawn(async move {
            client.set_nodelay(true)?;
            let mut server = TcpStream::connect(upstream).await?;
            server.set_nodelay(true)?;
            tokio::io::copy_bidirectional(&mut client, &mut server).await?;
            Ok::<_, std::io::Error>(())
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// Bytes go through both ways, and the upstream's close reaches the client.
    #[tokio::test]
    async fn bytes_go_both_ways_until_the_upstream_closes() {
        let upstream = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let upstream_addr = upstream.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut conn, _) = upstream.accept().await.unwrap();
            let mut asked = [0u8; 4];
            conn.read_exact(&mut asked).await.unwrap();
            conn.write_all(&[asked, *b"pong"].concat()).await.unwrap();
        });
        let relay = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let relay_addr = relay.local_addr().unwrap();
        tokio::spawn(serve(relay, upstream_addr));
        let mut client = TcpStream::connect(relay_addr).await.unwrap();
        client.write_all(b"ping").await.unwrap();
        let mut answer = Vec::new();
        client.read_to_end(&mut answer).await.unwrap();
        assert_eq!(answer, b"pingpong");
    }
}
