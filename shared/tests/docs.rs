//! docs/ARCHITECTURE.md names files and folders as the places of things:
//! each must exist, so the page cannot outlive a move.

use std::path::Path;

/// Where a name on the page may be relative to: the workspace, or the
/// source folder of the section naming it.
const BASES: &[&str] = &[
    "",
    "filter/src",
    "filter/src/worker",
    "admin/src",
    "admin/src/api",
    "admin/ui/src",
    "shared/src",
];

#[test]
fn every_place_the_architecture_page_names_exists() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let page =
        std::fs::read_to_string(root.join("docs/ARCHITECTURE.md")).expect("docs/ARCHITECTURE.md");
    let names: Vec<&str> = page
        .split('`')
        .skip(1)
        .step_by(2)
        .map(|name| name.split_whitespace().next().unwrap_or_default())
        .filter(|name| name.ends_with(".rs") || name.ends_with(".md") || name.ends_with('/'))
        .collect();
    assert!(names.len() > 40, "only {} names read", names.len());
    let missing: Vec<&&str> = names
        .iter()
        .filter(|name| !BASES.iter().any(|base| root.join(base).join(name).exists()))
        .collect();
    assert!(missing.is_empty(), "named but not there: {missing:?}");
}

/// The pages a reader follows links between: the README, the notes in
/// docs/ and the book's chapters.
fn linked_pages(root: &Path) -> Vec<std::path::PathBuf> {
    let mut pages = vec![root.join("README.md")];
    for dir in ["docs", "docs/book/src"] {
        let mut found: Vec<_> = std::fs::read_dir(root.join(dir))
            .unwrap_or_else(|e| panic!("{dir}: {e}"))
            .filter_map(|entry| entry.ok().map(|e| e.path()))
            .filter(|path| path.extension().is_some_and(|ext| ext == "md"))
            .collect();
        found.sort();
        pages.extend(found);
    }
    pages
}

/// A page's prose: code blocks and inline code left out (a link there is
/// an example, not a link).
fn prose(text: &str) -> String {
    let mut out = String::new();
    let mut in_block = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            in_block = !in_block;
            continue;
        }
        if in_block {
            continue;
        }
        let mut in_code = false;
        for piece in line.split('`') {
            if !in_code {
                out.push_str(piece);
            }
            in_code = !in_code;
        }
        out.push('\n');
    }
    out
}

/// The links of a page's prose: `[text](target)`, targets with no scheme.
fn local_links(text: &str) -> Vec<String> {
    let prose = prose(text);
    prose
        .split("](")
        .skip(1)
        .filter_map(|rest| rest.split_once(')').map(|(target, _)| target.trim()))
        .filter(|target| !target.contains("://") && !target.starts_with("mailto:"))
        .map(str::to_string)
        .collect()
}

/// The anchors a page's headings get (as GitHub and mdBook make them).
fn anchors(text: &str) -> Vec<String> {
    prose_headings(text)
        .iter()
        .map(|heading| {
            heading
                .to_lowercase()
                .chars()
                .filter(|c| c.is_alphanumeric() || matches!(c, '-' | '_' | ' '))
                .map(|c| if c == ' ' { '-' } else { c })
                .collect()
        })
        .collect()
}

fn prose_headings(text: &str) -> Vec<String> {
    let mut in_block = false;
    text.lines()
        .filter(|line| {
            if line.trim_start().starts_with("```") {
                in_block = !in_block;
            }
            !in_block && line.starts_with('#')
        })
        .map(|line| line.trim_start_matches('#').trim().to_string())
        .collect()
}

/// What a page says once mdBook's `{{#include FILE}}` is read: the
/// included page, where its own links are relative to.
fn included(page: &Path, text: &str) -> Option<std::path::PathBuf> {
    let inner = text
        .trim()
        .strip_prefix("{{#include ")?
        .strip_suffix("}}")?;
    Some(page.parent()?.join(inner.trim()))
}

#[test]
fn every_link_between_the_pages_resolves() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let pages = linked_pages(&root);
    assert!(pages.len() > 15, "{} pages", pages.len());
    let mut broken = Vec::new();
    let mut checked = 0;
    for page in &pages {
        let text = std::fs::read_to_string(page).unwrap_or_default();
        if let Some(source) = included(page, &text) {
            // Its links are checked where it lives (docs/).
            if !source.is_file() {
                broken.push(format!("{}: includes {}", page.display(), source.display()));
            }
            continue;
        }
        let dir = page.parent().unwrap_or(&root);
        for link in local_links(&text) {
            checked += 1;
            let (path, anchor) = link.split_once('#').unwrap_or((&link, ""));
            let target = if path.is_empty() {
                page.clone()
            } else {
                dir.join(path)
            };
            if !target.exists() {
                broken.push(format!("{}: {link}: no such file", page.display()));
                continue;
            }
            if anchor.is_empty() || target.extension().is_none_or(|ext| ext != "md") {
                continue;
            }
            let target_text = std::fs::read_to_string(&target).unwrap_or_default();
            let target_text = match included(&target, &target_text) {
                Some(source) => std::fs::read_to_string(source).unwrap_or_default(),
                None => target_text,
            };
            if !anchors(&target_text).iter().any(|a| a == anchor) {
                broken.push(format!("{}: {link}: no such heading", page.display()));
            }
        }
    }
    assert!(checked > 50, "only {checked} links read");
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn a_link_to_a_missing_heading_or_file_is_found() {
    let text = "# Fleet mode: one limit\n\n[a](#fleet-mode-one-limit) `[b](#no)`\n```\n[c](x)\n```\n[d](other.md#x)";
    assert_eq!(local_links(text), ["#fleet-mode-one-limit", "other.md#x"]);
    assert_eq!(anchors(text), ["fleet-mode-one-limit"]);
}
