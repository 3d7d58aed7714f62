//! Every policy the book and the README show is one the admin takes: each
//! code block marked as a policy (```` ```json,policy ```` or
//! ```` ```yaml,policy ````) is read as `sluice-admin apply -f` reads a
//! file (one policy, a list, or a set) and validated as the API validates;
//! a plugin configuration (it has a `fallback`) is read as the filter
//! reads its configuration. A JSON block that looks like a policy but is
//! not marked fails too, so that no example goes unchecked. A block that
//! fails names its file and line.

use std::path::{Path, PathBuf};

use sluice_admin::as_code::{load, SourceFile};

/// A fenced code block: where it starts, its info string, its text.
struct Block {
    place: String,
    info: String,
    text: String,
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The README and every page of the book.
fn pages() -> Vec<PathBuf> {
    let mut pages = vec![root().join("README.md")];
    let src = root().join("docs/book/src");
    let mut book: Vec<PathBuf> = std::fs::read_dir(&src)
        .unwrap_or_else(|e| panic!("{}: {e}", src.display()))
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|path| path.extension().is_some_and(|ext| ext == "md"))
        .collect();
    book.sort();
    pages.extend(book);
    pages
}

fn blocks(page: &Path) -> Vec<Block> {
    let text = std::fs::read_to_string(page).unwrap_or_else(|e| panic!("{}: {e}", page.display()));
    let name = page
        .strip_prefix(root())
        .unwrap_or(page)
        .display()
        .to_string();
    let mut out = Vec::new();
    let mut open: Option<Block> = None;
    // A block in a list item is indented as its fence is.
    let mut indent = 0;
    for (number, line) in text.lines().enumerate() {
        let fence = line.trim_start();
        match (&mut open, fence.strip_prefix("```")) {
            (None, Some(info)) => {
                indent = line.len() - fence.len();
                open = Some(Block {
                    place: format!("{name}:{}", number + 1),
                    info: info.trim().to_string(),
                    text: String::new(),
                });
            }
            (Some(_), Some(_)) => out.extend(open.take()),
            (Some(block), None) => {
                let strip = indent.min(line.len() - fence.len());
                block.text.push_str(&line[strip..]);
                block.text.push('\n');
            }
            (None, None) => {}
        }
    }
    out
}

fn is_policy(info: &str) -> bool {
    info.split(',')
        .skip(1)
        .any(|attribute| attribute.trim() == "policy")
}

/// What is wrong with a block marked as a policy, if anything.
fn check_policy(block: &Block) -> Option<String> {
    let yaml = block.info.starts_with("yaml");
    let parsed: Result<serde_json::Value, String> = if yaml {
        sluice_admin::as_code::parse_yaml(&block.text)
    } else {
        serde_json::from_str(&block.text).map_err(|e| e.to_string())
    };
    let value = match parsed {
        Ok(value) => value,
        Err(e) => return Some(format!("{}: does not parse: {e}", block.place)),
    };
    if value.get("fallback").is_some() {
        // A variable the configuration names is set where the book's
        // setup sets it (a pod's name, a Secret's token).
        let env = |_: &str| Some("set-by-the-deployment".to_string());
        return sluice_filter_core::plugin::parse_plugin_config_with_env(
            block.text.as_bytes(),
            &env,
        )
        .err()
        .map(|e| format!("{}: plugin configuration: {e}", block.place));
    }
    let file = SourceFile {
        path: format!("{}.{}", block.place, if yaml { "yaml" } else { "json" }),
        text: block.text.clone(),
    };
    match load(&[file]) {
        Ok(loaded) if loaded.policies.is_empty() => {
            Some(format!("{}: holds no policy", block.place))
        }
        Ok(_) => None,
        Err(errors) => Some(format!("{}: {errors}", block.place)),
    }
}

/// A JSON block not marked as a policy that looks like one.
fn unmarked_policy(block: &Block) -> Option<String> {
    if is_policy(&block.info) || !block.info.starts_with("json") {
        return None;
    }
    let value: serde_json::Value = serde_json::from_str(&block.text).ok()?;
    ["policies", "fallback", "match"]
        .iter()
        .any(|key| value.get(key).is_some())
        .then(|| format!("{}: a policy not marked `json,policy`", block.place))
}

#[test]
fn every_policy_in_the_book_and_the_readme_is_one_the_admin_takes() {
    let all: Vec<Block> = pages().iter().flat_map(|p| blocks(p)).collect();
    let marked: Vec<&Block> = all.iter().filter(|b| is_policy(&b.info)).collect();
    assert!(marked.len() >= 25, "only {} policy blocks", marked.len());
    assert!(
        marked.iter().any(|b| b.info.starts_with("yaml")),
        "no YAML policy block"
    );
    let failures: Vec<String> = marked
        .iter()
        .filter_map(|b| check_policy(b))
        .chain(all.iter().filter_map(unmarked_policy))
        .collect();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn a_bad_policy_block_is_named_by_its_file_and_line() {
    let block = |info: &str, text: &str| Block {
        place: "docs/book/src/policies.md:42".into(),
        info: info.into(),
        text: text.into(),
    };
    let bad = block(
        "json,policy",
        r#"{"version": 1, "policies": [{"name": "a", "match": {"host": "x"},
            "rate": {"requests": 10, "period": "1s", "burst": 0}}]}"#,
    );
    let said = check_policy(&bad).unwrap_or_default();
    assert!(
        said.starts_with("docs/book/src/policies.md:42") && said.contains("rate.burst"),
        "{said}"
    );
    let yaml = block(
        "yaml,policy",
        "name: b\nmatch: {host: x}\nrate: {requests: 0, period: 1s}\n",
    );
    assert!(check_policy(&yaml).is_some_and(|s| s.contains("rate.requests")));
    let config = block(
        "json,policy",
        r#"{"instance": "e", "fallback": {"version": 1, "policies": [{"name": "a",
            "match": {"host": "x"}, "rate": {"requests": 1, "period": "0s"}}]}}"#,
    );
    assert!(check_policy(&config).is_some_and(|s| s.contains("fallback.policies[0]")));
    let broken = block("json,policy", "{\"version\": 1,");
    assert!(check_policy(&broken).is_some_and(|s| s.contains("does not parse")));
    let unmarked = block("json", r#"{"name": "a", "match": {"host": "x"}}"#);
    assert!(unmarked_policy(&unmarked).is_some());
    assert!(unmarked_policy(&block("json", r#"{"admitted": 3}"#)).is_none());
}

/// Each price catalog the book shows (```` ```json,price-catalog ````)
/// imports, dry, into no table exactly as the next block marked
/// `price-import` says `sluice-admin prices import --dry-run` prints.
#[test]
fn every_price_catalog_in_the_book_imports_as_the_book_says() {
    use sluice_admin::price_catalog::{describe, merge, read, Selection};
    let mut checked = 0;
    for page in pages() {
        let blocks = blocks(&page);
        for (i, block) in blocks.iter().enumerate() {
            if !block.info.split(',').any(|a| a.trim() == "price-catalog") {
                continue;
            }
            let said = blocks[i + 1..]
                .iter()
                .find(|b| b.info.split(',').any(|a| a.trim() == "price-import"))
                .unwrap_or_else(|| panic!("{}: no `price-import` block after it", block.place));
            let catalog = read(&block.text, &Selection::default())
                .unwrap_or_else(|e| panic!("{}: {e}", block.place));
            let (_, imported) = merge(None, &catalog).unwrap();
            let printed = format!("{}dry run: nothing applied\n", describe(&imported));
            assert_eq!(printed, said.text, "{}", said.place);
            checked += 1;
        }
    }
    assert!(checked >= 1, "no price catalog in the book");
}

/// The file a block quotes (```` ```yaml,excerpt=envoy/stock-rlqs.yaml ````),
/// if it says.
fn excerpt_of(info: &str) -> Option<&str> {
    info.split(',')
        .skip(1)
        .find_map(|attribute| attribute.trim().strip_prefix("excerpt="))
}

/// Where `excerpt` is not `file`'s text: its lines must be lines of the
/// file one after another (each compared without its indent, which the
/// book may shift), so that a shipped configuration and the book's quote
/// of it never part.
fn excerpt_problem(excerpt: &str, file: &str) -> Option<String> {
    let wanted: Vec<&str> = excerpt
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    let lines: Vec<&str> = file.lines().map(str::trim).collect();
    let first = *wanted.first()?;
    let found = (0..lines.len()).any(|start| {
        lines[start] == first
            && wanted
                .iter()
                .zip(&lines[start..])
                .all(|(want, line)| want == line)
            && lines.len() - start >= wanted.len()
    });
    (!found).then(|| format!("not a run of lines of the file (from {first:?})"))
}

#[test]
fn every_excerpt_of_a_shipped_file_in_the_book_is_in_that_file() {
    let mut problems = Vec::new();
    let mut seen = 0;
    for page in pages() {
        for block in blocks(&page) {
            let Some(path) = excerpt_of(&block.info) else {
                continue;
            };
            seen += 1;
            match std::fs::read_to_string(root().join(path)) {
                Ok(file) => problems.extend(
                    excerpt_problem(&block.text, &file)
                        .map(|p| format!("{}: {path}: {p}", block.place)),
                ),
                Err(e) => problems.push(format!("{}: {path}: {e}", block.place)),
            }
        }
    }
    assert!(seen > 0, "no excerpt in the book");
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn an_excerpt_that_parted_from_its_file_is_found() {
    let file = "a:\n  b: 1\n  c: 2\nd: 3\n";
    assert_eq!(excerpt_problem("  b: 1\n  c: 2\n", file), None);
    assert!(excerpt_problem("b: 1\nd: 3\n", file).is_some());
    assert!(excerpt_problem("c: 2\nd: 3\ne: 4\n", file).is_some());
}
