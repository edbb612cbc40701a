//! `run` contenders (the real binary) and the apps beside them.

use super::*;

/// The app next to a `run` sidecar. It polls `/leader`; on a 200 it starts (or goes on with)
/// leader-only work under the answer's fencing token, writing to the store; it stops at once on
/// a 503, on an error, when a poll takes over 100 ms, or when the validity it was told runs out.
/// Told to stop (the pod shuts down), it ends its work with `end`: native sidecars are stopped
/// after the app, so the lock is released only then.
pub(crate) async fn app(
    identity: String,
    addr: SocketAddr,
    store: Arc<FencedStore>,
    stop: CancellationToken,
) {
    const WRITE_EVERY: Duration = Duration::from_millis(100);
    // (token, deadline, last write) of the work in progress.
    let mut work: Option<(u64, Instant, Instant)> = None;
    let end = |work: &mut Option<(u64, Instant, Instant)>| {
        if let Some((token, deadline, _)) = work.take() {
            if Instant::now() < deadline {
                store.write(&identity, token, Kind::End, Some(deadline));
            }
        }
    };
    while !stop.is_cancelled() {
        let sent = Instant::now();
        let answer = tokio::time::timeout(
            Duration::from_millis(100),
            support::http::get(addr, "/leader"),
        )
        .await;
        let leading = match answer {
            Ok(Ok(resp)) if resp.status == 200 => resp.json().ok().and_then(|body| {
                Some((
                    body["fencing_token"].as_u64()?,
                    body["validity_ms"].as_u64()?,
                ))
            }),
            _ => None,
        };
        let now = Instant::now();
        match (leading, work) {
            (Some((token, validity_ms)), current) => {
                let deadline = sent + Duration::from_millis(validity_ms);
                match current {
                    Some((t, _, last)) if t == token => {
                        let last = if now >= last + WRITE_EVERY {
                            store.write(&identity, token, Kind::Write, Some(deadline));
                            now
                        } else {
                            last
                        };
                        work = Some((token, deadline, last));
                    }
                    _ => {
                        end(&mut work);
                        store.write(&identity, token, Kind::Begin, Some(deadline));
                        work = Some((token, deadline, now));
                    }
                }
            }
            // Stop at once; no `end`: that marks a holder letting go on purpose.
            (None, Some((token, deadline, _))) => {
                store.gone(&identity, token, Some(deadline));
                work = None;
            }
            (None, None) => {}
        }
        if let Some((token, deadline, _)) = work.filter(|(_, deadline, _)| now >= *deadline) {
            // The validity it was told ran out with no fresh answer: stop, no more writes.
            store.gone(&identity, token, Some(deadline));
            work = None;
        }
        tokio::time::sleep(POLL).await;
    }
    end(&mut work);
}

pub(crate) struct RunMember {
    pub(crate) identity: String,
    pub(crate) addr: SocketAddr,
    pub(crate) proc: Proc,
    pub(crate) app_stop: CancellationToken,
    pub(crate) app: JoinHandle<()>,
}

/// `redlock-sidecar run` contenders on one lock, each with its app.
pub(crate) struct RunFleet {
    pub(crate) lock: String,
    pub(crate) urls: String,
    pub(crate) prefix: String,
    pub(crate) store: Arc<FencedStore>,
    pub(crate) members: Vec<RunMember>,
    pub(crate) started: u32,
    /// (identity, exit code) of members that were removed.
    pub(crate) exits: Vec<(String, i32)>,
}

impl RunFleet {
    pub(crate) fn start(lock: &str, prefix: &str, urls: &[String], n: usize) -> RunFleet {
        let mut fleet = RunFleet {
            lock: lock.to_owned(),
            urls: urls.join(","),
            prefix: prefix.to_owned(),
            store: FencedStore::new(),
            members: Vec::new(),
            started: 0,
            exits: Vec::new(),
        };
        for _ in 0..n {
            fleet.add();
        }
        fleet
    }

    /// Starts one more sidecar (a new pod) and its app.
    pub(crate) fn add(&mut self) {
        self.started += 1;
        let identity = format!("{}{}", self.prefix, self.started);
        let port = support::free_port();
        let listen = format!("127.0.0.1:{port}");
        let args: Vec<&str> = ["run", "--lock", &self.lock, "--redis", &self.urls]
            .into_iter()
            .chain(PROC_TIMING)
            .chain(["--listen", &listen, "--identity", &identity])
            .chain(["--kubernetes", "off"])
            .collect();
        let proc = Proc::spawn(&args, &[("REDLOCK_LOG", "info")]);
        let app_stop = CancellationToken::new();
        let addr: SocketAddr = listen.parse().expect("loopback address");
        let app = tokio::spawn(app(
            identity.clone(),
            addr,
            self.store.clone(),
            app_stop.clone(),
        ));
        self.members.push(RunMember {
            identity,
            addr,
            proc,
            app_stop,
            app,
        });
    }

    pub(crate) fn position(&self, identity: &str) -> Option<usize> {
        self.members.iter().position(|m| m.identity == identity)
    }

    /// The member whose app works as leader now.
    pub(crate) fn leader(&self) -> Option<(usize, String, u64)> {
        let (_, who, token) = self.store.last_begin()?;
        let i = self.position(&who)?;
        self.store.is_open(&who, token).then_some((i, who, token))
    }

    /// Removes member `i`. SIGTERM: its app ends its work first, then the sidecar gets SIGTERM.
    /// Anything else: the whole pod crashes (the app is aborted, the sidecar gets `sig`).
    pub(crate) async fn remove(&mut self, i: usize, sig: libc::c_int) -> i32 {
        let mut member = self.members.remove(i);
        if sig == libc::SIGTERM {
            member.app_stop.cancel();
            member.app.await.expect("app did not panic");
            member.proc.signal(sig);
        } else {
            // The pod crashes: the app dies mid-work (no `end`), and so does the sidecar.
            member.app.abort();
            let _ = member.app.await;
            member.proc.signal(sig);
        }
        let status = member
            .proc
            .wait_exit_async(Duration::from_secs(10))
            .await
            .unwrap_or_else(|| {
                panic!(
                    "{} did not exit\n{}",
                    member.identity,
                    member.proc.output_text()
                )
            });
        // Shown only if the test fails: what the sidecar saw, for the checker's verdict.
        println!(
            "--- {} (exit {status}) ---\n{}",
            member.identity,
            member.proc.output_text()
        );
        let code = exit_code(status);
        self.exits.push((member.identity, code));
        code
    }

    pub(crate) async fn stop(mut self) -> Vec<(String, i32)> {
        while !self.members.is_empty() {
            let code = self.remove(0, libc::SIGTERM).await;
            assert_eq!(code, 0, "a run sidecar exits 0 on SIGTERM");
        }
        self.exits
    }
}
