//! The shape of the product code that issue 51 set targets for and that a
//! change could quietly undo: parameters written as a destructured tuple,
//! `fn f((a, b): (A, B))`, stand for a type the code has not named (or for
//! two parameters), and were the habit that let values travel as parallel
//! slices. Product code is every crate's `src/` but the test crates' and
//! each file's test module.

use std::path::{Path, PathBuf};

/// The most tuple-destructured parameters product code may have (issue 51).
const MOST_TUPLE_PARAMETERS: usize = 10;

/// The folders whose `.rs` files are product code.
const PRODUCT_ROOTS: &[&str] = &["admin", "filter", "shared", "wire"];

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        if path.is_dir() {
            let skipped = [
                "tests",
                "test",
                "examples",
                "benches",
                "target",
                "node_modules",
            ];
            if !skipped.contains(&name.as_str()) && !name.starts_with('.') {
                rust_files(&path, out);
            }
        } else if name.ends_with(".rs") && !["tests.rs", "testing.rs"].contains(&name.as_str()) {
            out.push(path);
        }
    }
}

/// The text of a parenthesised list starting at `open` (an index of `(`),
/// without its parentheses.
fn inside_parens(text: &str, open: usize) -> Option<&str> {
    let mut depth = 0usize;
    for (i, c) in text[open..].char_indices() {
        match c {
            '(' => depth += 1,
            ')' => {
                depth -= 1;
                if depth == 0 {
                    return text.get(open + 1..open + i);
                }
            }
            _ => {}
        }
    }
    None
}

/// The list's items, split at commas outside any brackets.
fn top_level_items(list: &str) -> Vec<&str> {
    let (mut items, mut depth, mut start) = (Vec::new(), 0i32, 0);
    for (i, c) in list.char_indices() {
        match c {
            '(' | '[' | '<' | '{' => depth += 1,
            ')' | ']' | '>' | '}' => depth -= 1,
            ',' if depth == 0 => {
                items.push(&list[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    items.push(&list[start..]);
    items
}

/// Whether a parameter is a destructured tuple: `(a, b): (A, B)`.
fn is_tuple_pattern(parameter: &str) -> bool {
    let p = parameter.trim();
    let p = p.strip_prefix("mut ").unwrap_or(p).trim_start();
    let Some(close) = p.find(')') else {
        return false;
    };
    p.starts_with('(') && p[close + 1..].trim_start().starts_with(':')
}

/// Each tuple-destructured parameter of `source`'s functions before its
/// test module, as `file: pattern`.
fn tuple_parameters(file: &str, source: &str) -> Vec<String> {
    let product = source
        .find("#[cfg(test)]\nmod tests {")
        .map_or(source, |end| &source[..end]);
    let mut found = Vec::new();
    let mut from = 0;
    while let Some(at) = product[from..].find("fn ") {
        let start = from + at;
        from = start + 3;
        let word_start = start == 0 || !product.as_bytes()[start - 1].is_ascii_alphanumeric();
        let Some(open) = product[start..].find('(').map(|i| start + i) else {
            break;
        };
        // A signature's name and generics hold no `;`, `{` or `=`.
        let head = &product[start..open];
        if !word_start || head.contains([';', '{', '=', '\n']) {
            continue;
        }
        let Some(list) = inside_parens(product, open) else {
            continue;
        };
        for parameter in top_level_items(list) {
            if is_tuple_pattern(parameter) {
                let pattern = parameter.split(':').next().unwrap_or_default().trim();
                found.push(format!("{file}: {pattern}"));
            }
        }
    }
    found
}

#[test]
fn product_code_names_its_pairs_instead_of_destructuring_tuples() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut files = Vec::new();
    for dir in PRODUCT_ROOTS {
        rust_files(&root.join(dir), &mut files);
    }
    files.sort();
    assert!(
        files.len() > 100,
        "only {} product files found",
        files.len()
    );
    let mut found = Vec::new();
    for path in &files {
        let source = std::fs::read_to_string(path).expect("a product file reads");
        let name = path
            .strip_prefix(&root)
            .unwrap_or(path)
            .display()
            .to_string();
        found.extend(tuple_parameters(&name, &source));
    }
    println!("{} tuple-destructured parameters:", found.len());
    for f in &found {
        println!("  {f}");
    }
    assert!(
        found.len() <= MOST_TUPLE_PARAMETERS,
        "{} tuple-destructured parameters in product code (at most {MOST_TUPLE_PARAMETERS}): {found:#?}",
        found.len()
    );
}

#[test]
fn the_counter_finds_what_it_counts() {
    let source = "fn a((x, y): (u8, u8), z: u8) {}\n\
                  pub(super) fn b<T>(\n    ctx: &mut T,\n    mut (p, q): (u8, u8),\n) {}\n\
                  fn c(t: (u8, u8)) {}\n\
                  let f = |(x, y): (u8, u8)| x;\n\
                  #[cfg(test)]\nmod tests {\n    fn d((x, y): (u8, u8)) {}\n}\n";
    assert_eq!(
        tuple_parameters("f.rs", source),
        ["f.rs: (x, y)", "f.rs: mut (p, q)"]
    );
}
