//! A real Redis server (Debian's `redis-server`, which `make setup`
//! installs) on a free port, with nothing persisted; killed on drop.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use crate::envoy::free_port;

pub struct RedisServer {
    child: Child,
    pub port: u16,
}

impl RedisServer {
    pub fn start() -> anyhow::Result<Self> {
        let port = free_port()?;
        let binary = std::env::var("REDIS_SERVER_BIN").unwrap_or_else(|_| "redis-server".into());
        let child = Command::new(&binary)
            .args([
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {binary} (make setup installs redis-server)"))?;
        let mut server = Self { child, port };
        let deadline = Instant::now() + Duration::from_secs(10);
        while !server.ping() {
            if let Some(status) = server.child.try_wait()? {
                bail!("redis-server exited ({status})");
            }
            if Instant::now() > deadline {
                bail!("redis-server did not answer PING on port {port}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(server)
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    fn ping(&self) -> bool {
        let Ok(mut s) = TcpStream::connect(("127.0.0.1", self.port)) else {
            return false;
        };
        let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
        let mut answer = [0u8; 7];
        s.write_all(b"PING\r\n").is_ok()
            && s.read_exact(&mut answer).is_ok()
            && &answer == b"+PONG\r\n"
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
