//! Modules import only downwards: no import cycle anywhere in `src` (a name a facade
//! re-exports counts as an import of the module that defines it; `super::super::` paths climb
//! as the compiler resolves them), and the transport (`src/redlock/transport/`) never imports
//! the vote layer above it.
//!
//! Read from the source: every path that starts with `super::` or `crate::redlock::` (in `use`
//! lines and inline), resolved to the module it names. Unit-test modules are left out (a test
//! may reach anywhere). A `mod.rs` is a facade: it assembles its children (and re-exports
//! them), and children that add methods to its types import it back, so facades are no nodes
//! of the cycle check; the transport may not import the engine's facade (`src/redlock/mod.rs`)
//! at all.
//!
//! The lease core (`core/`) is checked the same way, and its manifest for the crates it may
//! never depend on.
//!
//! No file of the code (`src/`, `core/src/`) is over 600 lines and no function over 80: a
//! long file is split by concern into a directory module, a long function into named steps
//! (an explicit, reasoned allow-list holds what is still long for now).
//!
//! Time is read in one way: every timer and deadline is a `clock::Deadline` on the boot
//! clock. Clippy's `disallowed-methods` (clippy.toml) enforces it; this test checks that the
//! list stays complete and that only the clock modules allow an exception.

// Tests and benchmarks use Tokio's and std's timers directly (clippy.toml keeps them
// out of the sidecar's code).
#![allow(clippy::disallowed_methods)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The module of the engine's facade (`src/redlock/mod.rs`).
const FACADE: &str = "redlock";

/// Modules every layer may import: text with no imports of its own (the Lua scripts).
const SHARED_LEAVES: &[&str] = &["redlock::scripts"];

/// The module path of a source file: `src/redlock/transport/node.rs` → `redlock::transport::node`.
fn module_of(root: &Path, file: &Path) -> String {
    let relative = file.strip_prefix(root).expect("under src");
    let mut parts: Vec<String> = relative
        .with_extension("")
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    if parts.last().is_some_and(|p| p == "mod") {
        parts.pop();
    }
    parts.join("::")
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("readable source directory") {
        let path = entry.expect("directory entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The code of `text` without comments, string literals and its unit-test module.
fn code_of(text: &str) -> String {
    let mut code = String::new();
    let mut lines = text.lines().peekable();
    while let Some(line) = lines.next() {
        let trimmed = line.trim_start();
        if trimmed.starts_with("#[cfg(test)]")
            && lines
                .peek()
                .is_some_and(|next| next.trim_start().starts_with("mod tests"))
        {
            break;
        }
        if trimmed.starts_with("//") {
            continue;
        }
        let line = line.split(" //").next().unwrap_or_default();
        // Paths inside string literals are text, not imports.
        let mut in_string = false;
        for c in line.chars() {
            if c == '"' {
                in_string = !in_string;
            } else if !in_string {
                code.push(c);
            }
        }
        code.push('\n');
    }
    code
}

/// Every path in `code` that starts with `super::` or `crate::`, as absolute segment lists
/// (from the crate root), with `use` groups (`use super::{a, b::c}`) expanded one level.
fn paths_in(code: &str, module: &[&str], is_mod_rs: bool) -> Vec<Vec<String>> {
    // `super` of `a::b::c` (file c.rs) is `a::b`; of a `mod.rs` for `a::b`, it is `a`.
    let parent: Vec<&str> = if is_mod_rs || module.len() > 1 {
        module[..module.len() - 1].to_vec()
    } else {
        Vec::new()
    };
    let flat: String = code.split_whitespace().collect::<Vec<_>>().join(" ");
    let mut found = Vec::new();
    for (start, prefix) in ["super::", "crate::"]
        .iter()
        .flat_map(|p| flat.match_indices(p).map(move |(i, _)| (i, *p)))
    {
        let before = flat[..start].chars().last();
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
            continue;
        }
        let mut base: Vec<String> = if prefix == "super::" {
            parent.iter().map(|s| (*s).to_owned()).collect()
        } else {
            Vec::new()
        };
        let mut rest = &flat[start + prefix.len()..];
        // `super::super::x`: each further `super` goes one module up.
        while let Some(tail) = rest.strip_prefix("super::") {
            base.pop();
            rest = tail;
        }
        for tail in expand(rest) {
            let mut path = base.clone();
            path.extend(tail);
            found.push(path);
        }
    }
    found
}

/// The segment lists of the path at the start of `rest`: `a::b::C` → `[a, b, C]`;
/// `a::{b, c::d}` → `[a, b]`, `[a, c, d]`.
fn expand(rest: &str) -> Vec<Vec<String>> {
    let mut head = Vec::new();
    let mut chars = rest.char_indices().peekable();
    let mut word = String::new();
    while let Some((i, c)) = chars.next() {
        if c.is_alphanumeric() || c == '_' {
            word.push(c);
        } else if rest[i..].starts_with("::") {
            chars.next();
            head.push(std::mem::take(&mut word));
        } else if c == '{' && word.is_empty() {
            let inner = &rest[i + 1..];
            let end = inner.find('}').unwrap_or(inner.len());
            return inner[..end]
                .split(',')
                .filter_map(|item| {
                    let item = item.trim().trim_start_matches('{');
                    let first: String = item
                        .split("::")
                        .take(2)
                        .collect::<Vec<_>>()
                        .join("::")
                        .chars()
                        .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == ':')
                        .collect();
                    (!first.is_empty()).then(|| {
                        let mut path = head.clone();
                        path.extend(first.split("::").map(str::to_owned));
                        path
                    })
                })
                .collect();
        } else {
            break;
        }
    }
    if !word.is_empty() {
        head.push(word);
    }
    vec![head]
}

/// The longest prefix of `path` that is a known module (an item of the facade otherwise).
fn resolve(path: &[String], modules: &BTreeSet<String>) -> String {
    resolve_or(path, modules, FACADE)
}

/// The longest prefix of `path` that is a known module, else `root`.
fn resolve_or(path: &[String], modules: &BTreeSet<String>, root: &str) -> String {
    (1..=path.len())
        .rev()
        .map(|n| path[..n].join("::"))
        .find(|candidate| modules.contains(candidate))
        .unwrap_or_else(|| root.to_owned())
}

/// What `module`'s source re-exports: (module, name) → the module the path names
/// (`pub use child::{A, b::C}`, `pub use super::x::D`).
fn reexports(
    module: &str,
    is_mod_rs: bool,
    code: &str,
    modules: &BTreeSet<String>,
    out: &mut BTreeMap<(String, String), String>,
) {
    let segments: Vec<&str> = module.split("::").collect();
    let flat: String = code.split_whitespace().collect::<Vec<_>>().join(" ");
    for (start, _) in flat.match_indices("pub use ") {
        let rest = &flat[start + "pub use ".len()..];
        let statement = &rest[..rest.find(';').unwrap_or(rest.len())];
        let paths = if statement.starts_with("super::") || statement.starts_with("crate::") {
            paths_in(statement, &segments, is_mod_rs)
        } else {
            expand(statement)
                .into_iter()
                .map(|path| {
                    let mut full: Vec<String> = segments.iter().map(|s| (*s).to_owned()).collect();
                    full.extend(path);
                    full
                })
                .collect()
        };
        for path in paths {
            let Some(name) = path.last() else { continue };
            let target = resolve_or(&path, modules, "lib");
            if target != module {
                out.insert((module.to_owned(), name.clone()), target);
            }
        }
    }
}

/// [`resolve_or`], then through re-exports, to the module that defines the name:
/// `super::round::AcquireRound` names `round::acquire`, not the facade that re-exports it.
fn resolve_through(
    path: &[String],
    modules: &BTreeSet<String>,
    reexported: &BTreeMap<(String, String), String>,
) -> String {
    let mut module = resolve_or(path, modules, "lib");
    let depth = if module == "lib" {
        0
    } else {
        module.split("::").count()
    };
    let Some(name) = path.get(depth) else {
        return module;
    };
    // A chain of re-exports is short; the bound keeps a mistaken loop finite.
    for _ in 0..8 {
        match reexported.get(&(module.clone(), name.clone())) {
            Some(next) if *next != module => module = next.clone(),
            _ => break,
        }
    }
    module
}

/// Module → the modules of the whole crate it imports (`lib` is the crate root), and the
/// facades: the root and every module with modules under it (which assemble and re-export
/// them, as `mod.rs` files do). A path to a name a facade re-exports counts as an import of
/// the module that defines it; only what a facade defines itself (and children that add
/// methods to its types import back) keeps the facade out of the cycle check.
fn crate_graph() -> (BTreeMap<String, BTreeSet<String>>, BTreeSet<String>) {
    graph_of_crate(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"))
}

/// [`crate_graph`] of the crate whose sources are under `src`.
fn graph_of_crate(src: &Path) -> (BTreeMap<String, BTreeSet<String>>, BTreeSet<String>) {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    files.retain(|f| !f.ends_with("main.rs") && f.file_name().is_some_and(|n| n != "tests.rs"));
    let modules: BTreeSet<String> = files.iter().map(|f| module_of(src, f)).collect();
    let facades: BTreeSet<String> = modules
        .iter()
        .filter(|m| *m == "lib" || modules.iter().any(|c| c.starts_with(&format!("{m}::"))))
        .cloned()
        .collect();
    let mut reexported = BTreeMap::new();
    for file in &files {
        let module = module_of(src, file);
        let is_mod_rs = file.file_name().is_some_and(|n| n == "mod.rs");
        let text = std::fs::read_to_string(file).expect("readable source");
        reexports(
            &module,
            is_mod_rs,
            &code_of(&text),
            &modules,
            &mut reexported,
        );
    }
    let mut graph = BTreeMap::new();
    for file in &files {
        let module = module_of(src, file);
        let segments: Vec<&str> = module.split("::").collect();
        let is_mod_rs = file.file_name().is_some_and(|n| n == "mod.rs");
        let text = std::fs::read_to_string(file).expect("readable source");
        let targets: BTreeSet<String> = paths_in(&code_of(&text), &segments, is_mod_rs)
            .iter()
            .map(|path| resolve_through(path, &modules, &reexported))
            .filter(|target| *target != module)
            .collect();
        graph.insert(module, targets);
    }
    (graph, facades)
}

/// Module → the modules of `src/redlock` it imports, and the facades (`mod.rs` files).
fn import_graph() -> (BTreeMap<String, BTreeSet<String>>, BTreeSet<String>) {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src.join("redlock"), &mut files);
    let modules: BTreeSet<String> = files.iter().map(|f| module_of(&src, f)).collect();
    let facades: BTreeSet<String> = files
        .iter()
        .filter(|f| f.file_name().is_some_and(|n| n == "mod.rs"))
        .map(|f| module_of(&src, f))
        .collect();
    let mut graph = BTreeMap::new();
    for file in &files {
        let module = module_of(&src, file);
        let segments: Vec<&str> = module.split("::").collect();
        let is_mod_rs = file.file_name().is_some_and(|n| n == "mod.rs");
        let text = std::fs::read_to_string(file).expect("readable source");
        let targets: BTreeSet<String> = paths_in(&code_of(&text), &segments, is_mod_rs)
            .iter()
            .filter(|path| path.first().is_some_and(|s| s == "redlock") && path.len() > 1)
            .map(|path| resolve(path, &modules))
            .filter(|target| *target != module)
            .collect();
        graph.insert(module, targets);
    }
    (graph, facades)
}

/// A cycle among the modules of `graph` other than the `facades`, if there is one.
fn find_cycle(
    graph: &BTreeMap<String, BTreeSet<String>>,
    facades: &BTreeSet<String>,
) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        facades: &BTreeSet<String>,
        stack: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = stack.iter().position(|n| n == node) {
            let mut cycle = stack[at..].to_vec();
            cycle.push(node.to_owned());
            return Some(cycle);
        }
        if facades.contains(node) || !done.insert(node.to_owned()) {
            return None;
        }
        stack.push(node.to_owned());
        for next in graph.get(node).into_iter().flatten() {
            if let Some(cycle) = visit(next, graph, facades, stack, done) {
                return Some(cycle);
            }
        }
        stack.pop();
        None
    }
    let mut done = BTreeSet::new();
    graph
        .keys()
        .find_map(|start| visit(start, graph, facades, &mut Vec::new(), &mut done))
}

fn is_transport(module: &str) -> bool {
    module == "redlock::transport" || module.starts_with("redlock::transport::")
}

#[test]
fn the_engine_has_no_import_cycle() {
    let (graph, facades) = import_graph();
    assert!(
        graph.len() > 10 && graph.contains_key("redlock::transport::node"),
        "the source was read: {:?}",
        graph.keys()
    );
    assert!(facades.contains(FACADE) && facades.contains("redlock::transport"));
    assert_eq!(
        find_cycle(&graph, &facades),
        None,
        "import graph: {graph:#?}"
    );
}

#[test]
fn no_module_of_the_crate_is_in_an_import_cycle() {
    let (graph, facades) = crate_graph();
    assert!(
        graph.contains_key("locks::dapr") && graph.contains_key("redlock::votes"),
        "the source was read: {:?}",
        graph.keys()
    );
    assert!(facades.contains("lib") && facades.contains("locks"));
    assert_eq!(
        find_cycle(&graph, &facades),
        None,
        "import graph: {graph:#?}"
    );
}

/// The lease core's crate directory (`core/`, a member of the workspace).
fn lease_core() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("core")
}

#[test]
fn no_module_of_the_lease_core_is_in_an_import_cycle() {
    let (graph, facades) = graph_of_crate(&lease_core().join("src"));
    assert!(
        graph.contains_key("round::acquire") && graph.contains_key("tenure"),
        "the source was read: {:?}",
        graph.keys()
    );
    assert!(facades.contains("lib") && facades.contains("round"));
    assert_eq!(
        find_cycle(&graph, &facades),
        None,
        "import graph: {graph:#?}"
    );
}

/// The crates the lease core may never depend on: a runtime, a Redis client, a Kubernetes
/// client, an HTTP stack. The compiler then keeps every module of it free of I/O.
const NOT_IN_THE_CORE: &[&str] = &[
    "tokio",
    "redis",
    "kube",
    "k8s-openapi",
    "hyper",
    "axum",
    "tonic",
    "futures",
    "mio",
];

/// The names in the `[dependencies]`-like tables of a Cargo manifest.
fn dependencies_of(manifest: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut in_deps = false;
    for line in manifest.lines().map(str::trim) {
        if line.starts_with('[') {
            in_deps = line.contains("dependencies");
            // `[dependencies.name]`
            if let Some(name) = line
                .trim_matches(|c| c == '[' || c == ']')
                .split_once("dependencies.")
                .map(|(_, name)| name.to_owned())
            {
                names.push(name);
                in_deps = false;
            }
        } else if in_deps && !line.starts_with('#') {
            if let Some((name, _)) = line.split_once('=') {
                names.push(name.trim().trim_matches('"').to_owned());
            }
        }
    }
    names
}

#[test]
fn the_lease_core_depends_on_no_runtime_nor_client() {
    let manifest =
        std::fs::read_to_string(lease_core().join("Cargo.toml")).expect("core/Cargo.toml");
    let deps = dependencies_of(&manifest);
    assert!(
        deps.contains(&"libc".to_owned()),
        "the manifest was read: {deps:?}"
    );
    for dep in &deps {
        assert!(
            !NOT_IN_THE_CORE.iter().any(|banned| dep.starts_with(banned)),
            "the lease core depends on {dep}"
        );
    }
    let planted = "[dependencies]\nlibc = \"0.2\"\n\n[dependencies.tokio]\nversion = \"1\"\n";
    assert_eq!(dependencies_of(planted), ["libc", "tokio"]);
}

#[test]
fn the_transport_never_imports_the_vote_layer() {
    let (graph, _) = import_graph();
    for (module, imports) in graph.iter().filter(|(m, _)| is_transport(m)) {
        for target in imports {
            assert!(
                is_transport(target) || SHARED_LEAVES.contains(&target.as_str()),
                "{module} imports {target}, above the transport"
            );
        }
    }
}

#[test]
fn shared_leaves_import_nothing_of_the_engine() {
    let (graph, _) = import_graph();
    for leaf in SHARED_LEAVES {
        assert_eq!(graph.get(*leaf), Some(&BTreeSet::new()), "{leaf}");
    }
}

#[test]
fn the_check_reads_paths_as_the_compiler_resolves_them_and_sees_a_cycle() {
    let modules: BTreeSet<String> = [
        "redlock",
        "redlock::a",
        "redlock::b",
        "redlock::transport",
        "redlock::transport::t",
    ]
    .map(str::to_owned)
    .into();
    let code = code_of("use super::b::Thing;\n// use super::c;\nlet s = \"super::d\";\n");
    let from_a = paths_in(&code, &["redlock", "a"], false);
    assert_eq!(
        from_a,
        [["redlock", "b", "Thing"].map(str::to_owned).to_vec()]
    );
    let from_t = paths_in(
        "use super::{t::X, Y};\nlet k = crate::redlock::b::f();",
        &["redlock", "transport", "t"],
        false,
    );
    let resolved: Vec<String> = from_t.iter().map(|p| resolve(p, &modules)).collect();
    assert_eq!(
        resolved,
        ["redlock::transport::t", "redlock::transport", "redlock::b"]
    );
    let from_mod_rs = paths_in("use super::b;", &["redlock", "transport"], true);
    assert_eq!(resolve(&from_mod_rs[0], &modules), "redlock::b");
    // `super::super::` climbs one module per `super`, past the facade between.
    let climbing = paths_in(
        "use super::super::b::Thing;",
        &["redlock", "transport", "t"],
        false,
    );
    assert_eq!(resolve(&climbing[0], &modules), "redlock::b");
    // A name a facade re-exports resolves to the module that defines it, through a chain.
    let mut reexported = BTreeMap::new();
    reexports(
        "redlock",
        true,
        "pub use a::{Thing, Other};",
        &modules,
        &mut reexported,
    );
    reexports(
        "redlock::a",
        false,
        "pub use super::b::Other;",
        &modules,
        &mut reexported,
    );
    let through = |code: &str| {
        paths_in(code, &["redlock", "transport", "t"], false)
            .iter()
            .map(|p| resolve_through(p, &modules, &reexported))
            .collect::<Vec<_>>()
    };
    assert_eq!(through("use super::super::Thing;"), ["redlock::a"]);
    assert_eq!(through("use crate::redlock::Other;"), ["redlock::b"]);
    assert_eq!(through("use super::super::Defined;"), ["redlock"]);
    let facades = BTreeSet::from([FACADE.to_owned()]);
    let mut graph = BTreeMap::new();
    graph.insert(
        "redlock::a".to_owned(),
        BTreeSet::from(["redlock::b".to_owned()]),
    );
    graph.insert(
        "redlock::b".to_owned(),
        BTreeSet::from(["redlock::a".to_owned()]),
    );
    assert!(find_cycle(&graph, &facades).is_some());
    graph.insert("redlock::b".to_owned(), BTreeSet::from([FACADE.to_owned()]));
    assert_eq!(find_cycle(&graph, &facades), None);
}

/// The longest a source file of the code (`src/`, `core/src/`) may be, in lines.
const MAX_FILE_LINES: usize = 600;
/// The longest a function may be, from its `fn` line to its closing brace.
const MAX_FN_LINES: usize = 80;

/// Files of the code allowed past those bounds for now (paths from the repository's root),
/// each with the reason. An entry no longer needed fails the test: remove it then.
const LONG_FOR_NOW: &[(&str, &str)] = &[];

/// The length of each function in `text` (from its `fn` line to the brace that closes it at
/// the same indentation), by name.
fn function_lengths(text: &str) -> Vec<(String, usize)> {
    const QUALIFIERS: &[&str] = &[
        "pub(crate) ",
        "pub(super) ",
        "pub ",
        "async ",
        "const ",
        "unsafe ",
        "extern \"C\" ",
    ];
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    for (start, line) in lines.iter().enumerate() {
        let trimmed = line.trim_start();
        let indent = line.len() - trimmed.len();
        let mut signature = trimmed;
        while let Some(rest) = QUALIFIERS
            .iter()
            .find_map(|qualifier| signature.strip_prefix(qualifier))
        {
            signature = rest;
        }
        let Some(after_fn) = signature.strip_prefix("fn ") else {
            continue;
        };
        let closing = format!("{}}}", " ".repeat(indent));
        if let Some(end) = lines[start..].iter().position(|l| *l == closing) {
            let name: String = after_fn
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            out.push((name, end + 1));
        }
    }
    out
}

/// What is too long in `text` (the file at `path`): the file, and each function.
fn too_long(path: &str, text: &str) -> Vec<String> {
    let mut found = Vec::new();
    let lines = text.lines().count();
    if lines > MAX_FILE_LINES {
        found.push(format!("{path}: {lines} lines"));
    }
    for (name, length) in function_lengths(text) {
        if length > MAX_FN_LINES {
            found.push(format!("{path}: fn {name} is {length} lines"));
        }
    }
    found
}

#[test]
fn every_file_and_function_of_the_code_is_short() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    rust_files(&root.join("src"), &mut files);
    rust_files(&root.join("core").join("src"), &mut files);
    let paths: BTreeMap<String, PathBuf> = files
        .into_iter()
        .map(|file| {
            let relative = file.strip_prefix(root).expect("under the crate");
            (relative.to_string_lossy().into_owned(), file)
        })
        .collect();
    assert!(
        paths.contains_key("src/redlock/transport/node.rs")
            && paths.contains_key("core/src/tenure.rs"),
        "the code was read: {:?}",
        paths.keys()
    );
    let mut over = Vec::new();
    let mut allowed = BTreeSet::new();
    for (path, file) in &paths {
        let text = std::fs::read_to_string(file).expect("readable source");
        let found = too_long(path, &text);
        if found.is_empty() {
            continue;
        }
        if LONG_FOR_NOW
            .iter()
            .any(|(long_for_now, _)| long_for_now == path)
        {
            allowed.insert(path.as_str());
        } else {
            over.extend(found);
        }
    }
    assert!(
        over.is_empty(),
        "past {MAX_FILE_LINES} lines a file or {MAX_FN_LINES} a function: split the file by \
         concern (a directory module), the function into named steps\n{}",
        over.join("\n")
    );
    for (path, reason) in LONG_FOR_NOW {
        assert!(
            allowed.contains(path),
            "{path} may be long ({reason}) but is not: remove it from LONG_FOR_NOW"
        );
    }
    // The measure itself: a function's lines, its qualifiers read past; a file's lines.
    let long = "pub(crate) async unsafe fn long() {\n".to_owned() + &"    x;\n".repeat(90) + "}\n";
    assert_eq!(function_lengths(&long), [("long".to_owned(), 92)]);
    assert_eq!(too_long("f.rs", &long), ["f.rs: fn long is 92 lines"]);
    let big = "// x\n".repeat(MAX_FILE_LINES + 1);
    assert_eq!(too_long("f.rs", &big), ["f.rs: 601 lines"]);
}

/// The timers and clock reads clippy.toml keeps out of the code (`disallowed-methods`): every
/// lock deadline is a `clock::Deadline` on the boot clock, and a relative pause, one call's
/// own bound or a latency goes through the clock module's named helpers.
const TIMERS_ONLY_THROUGH_THE_CLOCK: &[&str] = &[
    "std::time::Instant::now",
    "tokio::time::Instant::now",
    "std::thread::sleep",
    "tokio::time::sleep",
    "tokio::time::sleep_until",
    "tokio::time::interval",
    "tokio::time::interval_at",
    "tokio::time::timeout",
    "tokio::time::timeout_at",
];

#[test]
fn clippy_keeps_timers_in_the_clock_module() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = std::fs::read_to_string(root.join("clippy.toml")).expect("clippy.toml");
    for path in TIMERS_ONLY_THROUGH_THE_CLOCK {
        assert!(
            config.contains(&format!("path = \"{path}\"")),
            "clippy.toml no longer disallows {path}"
        );
    }
    // The exceptions live in the clock modules (and unit tests): an `allow` anywhere else in
    // the code would undo the rule without a review of the clock.
    let mut files = Vec::new();
    rust_files(&root.join("src"), &mut files);
    rust_files(&root.join("core").join("src"), &mut files);
    let mut allowed_in = BTreeSet::new();
    for file in &files {
        let text = std::fs::read_to_string(file).expect("readable source");
        let code = code_of(&text);
        // `cfg_attr(test, allow(..))` (unit tests) is not an exception of the code.
        if code.contains("[allow(clippy::disallowed_methods)]") {
            let relative = file.strip_prefix(root).expect("under the crate");
            allowed_in.insert(relative.to_string_lossy().into_owned());
        }
    }
    assert_eq!(
        allowed_in,
        BTreeSet::from(["core/src/clock.rs".to_owned(), "src/clock.rs".to_owned()]),
        "only the clock modules may allow a disallowed timer"
    );
}
