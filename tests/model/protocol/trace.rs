//! One line per state, for the counterexamples' traces.

use std::fmt::{self, Write as _};

use super::*;

impl Config {
    /// One line for a state: the time, each node, each client.
    pub fn describe(&self, s: &State) -> String {
        let mut f = String::new();
        self.describe_into(&mut f, s).expect("writing to a String");
        f
    }

    pub(super) fn describe_into(&self, f: &mut String, s: &State) -> fmt::Result {
        write!(f, "t={:<2}", s.now)?;
        for (n, node) in s.nodes.iter().enumerate().take(self.nodes) {
            let d = &node.data;
            let mut line = String::new();
            match d.key {
                Some(k) => write!(line, "key=c{}#{}<{}", k.client, k.nonce, k.expires)?,
                None => line.push_str("key=-"),
            }
            write!(line, " fence={}", d.fence)?;
            if let Some((v, at)) = d.register {
                write!(line, " reg={v}<{at}")?;
            }
            if let Some((set, at, written)) = d.record {
                write!(line, " rec=#{set}@{written}<{at}")?;
            }
            match d.marker {
                Some(m) => write!(
                    line,
                    " epoch={}.{}@{}",
                    m.lineage.run,
                    m.lineage.repl,
                    m.stamped.map_or("old".to_owned(), |t| t.to_string())
                )?,
                None => line.push_str(" epoch=-"),
            }
            write!(f, " | n{n}[{line} id={}.{}]", node.id.run, node.id.repl)?;
        }
        for (c, client) in s.clients.iter().enumerate().take(self.clients.len()) {
            let phase = match client.phase {
                Phase::Idle => "idle".to_owned(),
                Phase::Acquire { start, reads, .. } => {
                    let mut phase = format!("acquire@{start}");
                    for (n, read) in reads.iter().enumerate() {
                        if let Some((register, at)) = read {
                            write!(phase, " read n{n}={register}@{at}")?;
                        }
                    }
                    phase
                }
                Phase::Raise { token, .. } => format!("raise {token}"),
                Phase::Cleanup { .. } => "cleanup".to_owned(),
                Phase::Hold {
                    token, end, extend, ..
                } => format!(
                    "hold token={token} end={end}{}",
                    if extend.is_some() { " extending" } else { "" }
                ),
                Phase::Lost { end, .. } => format!("lost end={end}"),
            };
            let window = client
                .window
                .map_or(String::new(), |(a, b)| format!(" app=[{a},{b})"));
            let paused = if client.paused { " paused" } else { "" };
            write!(f, " | c{c}[{phase}{window}{paused}]")?;
        }
        Ok(())
    }
}
