//! `guard` contenders (the real binary) running a CMD that writes to the fenced store.

use super::*;

/// CMD for guard: a bash one-liner that writes `begin`, then `writes` times `write` with `every`
/// between them, then `end`, to the store over loopback TCP; it exits 91/92/93 as soon as the
/// store refuses a write. `sleep` gets no copy of the socket, so the store sees the connection
/// close the moment bash dies.
pub(crate) fn guard_cmd(store_port: u16, writes: u32, every: &str) -> String {
    format!(
        r#"exec 3<>/dev/tcp/127.0.0.1/{store_port} || exit 90
say() {{ echo "$1 $REDLOCK_FENCING_TOKEN $REDLOCK_HOLDER $$" >&3 && read -r reply <&3 && [ "$reply" = ok ]; }}
say begin || exit 91
i=0
while [ $i -lt {writes} ]; do sleep {every} 3>&-; say write || exit 92; i=$((i+1)); done
say end || exit 93"#
    )
}

pub(crate) struct GuardRun {
    pub(crate) identity: String,
    pub(crate) proc: Proc,
    /// Its critical section is one of [`LONG_SECTIONS`].
    pub(crate) long: bool,
    /// A fault was aimed at it: its exit code is judged by the fleet's `fault_codes`.
    pub(crate) struck: bool,
}

/// How a guard run ended.
#[derive(Clone, Debug)]
pub(crate) struct GuardExit {
    pub(crate) identity: String,
    /// Exit code, or 128+signal.
    pub(crate) code: i32,
    pub(crate) long: bool,
    pub(crate) struck: bool,
}

#[derive(Default)]
pub(crate) struct GuardSlot {
    pub(crate) current: Option<GuardRun>,
    pub(crate) runs: u32,
    /// Every finished run.
    pub(crate) exits: Vec<GuardExit>,
    /// Output of runs that exited with an unexpected code.
    pub(crate) unexpected: Vec<String>,
    /// While set, the supervisor does not start a new run in this slot.
    pub(crate) frozen: bool,
}

impl GuardSlot {
    /// Marks the current run as struck by a fault; false if there is none.
    pub(crate) fn strike(&mut self) -> bool {
        self.current.as_mut().map(|run| run.struck = true).is_some()
    }
}

/// Guard contenders: one supervisor per slot keeps a `redlock-sidecar guard` running in it,
/// starting a new one (with a new identity) whenever the last one exits.
///
/// Each run's CMD writes `sections[k]` times (see [`guard_cmd`]), the slots taking the sections
/// in turn from different starting points. A run no fault was aimed at must exit 0: CMD's own
/// code after a section whose every write was accepted, however long it held the lock. A
/// struck run may exit with one of the scenario's `fault_codes`.
pub(crate) struct GuardFleet {
    pub(crate) slots: Vec<Arc<Mutex<GuardSlot>>>,
    pub(crate) stop: CancellationToken,
    pub(crate) tasks: Vec<JoinHandle<()>>,
}

impl GuardFleet {
    /// `urls[i]` are slot i's node URLs; CMDs write to the store on `store_port`.
    pub(crate) fn start(
        lock: &str,
        prefix: &str,
        urls: &[Vec<String>],
        store_port: u16,
        sections: &[u32],
        fault_codes: &'static [i32],
    ) -> GuardFleet {
        let stop = CancellationToken::new();
        let mut slots = Vec::new();
        let mut tasks = Vec::new();
        for (i, urls) in urls.iter().enumerate() {
            let slot = Arc::new(Mutex::new(GuardSlot::default()));
            let mut args: Vec<String> = ["guard", "--lock", lock, "--redis", &urls.join(",")]
                .iter()
                .chain(PROC_TIMING.iter())
                .chain(
                    [
                        "--kill-grace",
                        "300ms",
                        // Long sections of the others come first: never give up waiting.
                        "--wait",
                        "10m",
                        "--on-busy",
                        "fail",
                    ]
                    .iter(),
                )
                .map(|s| s.to_string())
                .collect();
            args.push("--identity".into());
            let mut cmds: Vec<(String, bool)> = sections
                .iter()
                .map(|&writes| {
                    let long = LONG_SECTIONS.contains(&writes);
                    (guard_cmd(store_port, writes, "0.05"), long)
                })
                .collect();
            let start = i % cmds.len();
            cmds.rotate_left(start);
            tasks.push(tokio::spawn(supervise_guard(
                slot.clone(),
                format!("{prefix}{i}."),
                args,
                cmds,
                fault_codes,
                stop.clone(),
            )));
            slots.push(slot);
        }
        GuardFleet { slots, stop, tasks }
    }

    /// The slot of a guard identity (`{prefix}{slot}.{run}`).
    pub(crate) fn slot_of(identity: &str) -> usize {
        let (head, _) = identity.rsplit_once('.').expect("guard identity");
        let digits = head.trim_start_matches(|c: char| !c.is_ascii_digit());
        digits.parse().expect("slot number")
    }

    /// Runs `f` on the guard process of `identity` if it is still the current run of its slot.
    pub(crate) fn with_run<T>(
        &self,
        identity: &str,
        f: impl FnOnce(&mut GuardSlot) -> T,
    ) -> Option<T> {
        let mut slot = self.slots[Self::slot_of(identity)]
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let current = slot
            .current
            .as_ref()
            .is_some_and(|r| r.identity == identity);
        current.then(|| f(&mut slot))
    }

    /// Every finished run so far.
    pub(crate) fn exits(&self) -> Vec<GuardExit> {
        self.slots
            .iter()
            .flat_map(|slot| slot.lock().unwrap_or_else(|e| e.into_inner()).exits.clone())
            .collect()
    }

    /// Stops every supervisor (their guards are killed) and returns every finished run;
    /// panics with the output of runs that exited with an unexpected code.
    pub(crate) async fn stop(self) -> Vec<GuardExit> {
        self.stop.cancel();
        for task in self.tasks {
            task.await.expect("supervisor did not panic");
        }
        let mut exits = Vec::new();
        for slot in &self.slots {
            let slot = slot.lock().unwrap_or_else(|e| e.into_inner());
            assert!(
                slot.unexpected.is_empty(),
                "guard exited with an unexpected code:\n{}",
                slot.unexpected.join("\n")
            );
            exits.extend(slot.exits.iter().cloned());
        }
        exits
    }
}

pub(crate) async fn supervise_guard(
    slot: Arc<Mutex<GuardSlot>>,
    prefix: String,
    args: Vec<String>,
    cmds: Vec<(String, bool)>,
    fault_codes: &'static [i32],
    stop: CancellationToken,
) {
    loop {
        {
            let mut s = slot.lock().unwrap_or_else(|e| e.into_inner());
            let finished = s
                .current
                .as_mut()
                .and_then(|run| run.proc.try_status().map(|st| (run, exit_code(st))))
                .map(|(run, code)| {
                    let expected = if run.struck {
                        fault_codes.contains(&code)
                    } else {
                        code == 0
                    };
                    let unexpected = (!expected).then(|| {
                        format!(
                            "{} exited {code} ({}):\n{}",
                            run.identity,
                            if run.struck {
                                "struck by a fault"
                            } else {
                                "no fault aimed at it: CMD's own 0 expected"
                            },
                            run.proc.output_text()
                        )
                    });
                    let exit = GuardExit {
                        identity: run.identity.clone(),
                        code,
                        long: run.long,
                        struck: run.struck,
                    };
                    (exit, unexpected)
                });
            if let Some((exit, unexpected)) = finished {
                s.exits.push(exit);
                s.unexpected.extend(unexpected);
                s.current = None;
            }
            if stop.is_cancelled() {
                s.current = None; // dropping a Proc kills and reaps it
                return;
            }
            if s.current.is_none() && !s.frozen {
                let (cmd, long) = &cmds[s.runs as usize % cmds.len()];
                s.runs += 1;
                let identity = format!("{prefix}{}", s.runs);
                let argv: Vec<&str> = args
                    .iter()
                    .map(String::as_str)
                    .chain([identity.as_str(), "--", "bash", "-c", cmd])
                    .collect();
                let proc = Proc::spawn(&argv, &[("REDLOCK_LOG", "info")]);
                s.current = Some(GuardRun {
                    identity,
                    proc,
                    long: *long,
                    struck: false,
                });
            }
        }
        tokio::time::sleep(POLL).await;
    }
}
