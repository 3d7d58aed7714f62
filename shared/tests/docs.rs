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

/// A workspace crate as its Cargo.toml says.
struct Crate {
    name: String,
    folder: String,
    /// The Sluice crates it depends on.
    uses: Vec<String>,
    /// Those only its tests use besides (dev-dependencies).
    tests_use: Vec<String>,
}

/// The workspace's crates as `cargo metadata` reads their Cargo.toml
/// files, in the workspace's order.
fn crate_graph(root: &Path) -> Vec<Crate> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = std::process::Command::new(cargo)
        .args([
            "metadata",
            "--format-version",
            "1",
            "--no-deps",
            "--offline",
        ])
        .current_dir(root)
        .output()
        .expect("cargo metadata runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).expect("metadata is JSON");
    let root_dir = meta["workspace_root"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let members: Vec<&str> = meta["workspace_members"]
        .as_array()
        .map(|m| m.iter().filter_map(|id| id.as_str()).collect())
        .unwrap_or_default();
    let mut crates = Vec::new();
    for id in members {
        let Some(package) = meta["packages"]
            .as_array()
            .and_then(|p| p.iter().find(|p| p["id"].as_str() == Some(id)))
        else {
            continue;
        };
        let name = package["name"].as_str().unwrap_or_default().to_string();
        let manifest = package["manifest_path"].as_str().unwrap_or_default();
        let folder = Path::new(manifest)
            .parent()
            .and_then(|dir| dir.strip_prefix(&root_dir).ok())
            .map(|dir| format!("{}/", dir.display()))
            .unwrap_or_default();
        let sluice_deps = |kind: Option<&str>| -> Vec<String> {
            let mut deps: Vec<String> = package["dependencies"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|d| d["kind"].as_str() == kind)
                .filter_map(|d| d["name"].as_str())
                .filter(|n| n.starts_with("sluice-"))
                .map(str::to_string)
                .collect();
            deps.sort();
            deps.dedup();
            deps
        };
        let uses = sluice_deps(None);
        let tests_use: Vec<String> = sluice_deps(Some("dev"))
            .into_iter()
            .filter(|d| !uses.contains(d))
            .collect();
        crates.push(Crate {
            name,
            folder,
            uses,
            tests_use,
        });
    }
    crates
}

/// The crates table of docs/ARCHITECTURE.md, as it must read.
fn crates_table(crates: &[Crate]) -> String {
    let list = |names: &[String]| {
        if names.is_empty() {
            "—".to_string()
        } else {
            names
                .iter()
                .map(|n| format!("`{n}`"))
                .collect::<Vec<_>>()
                .join(", ")
        }
    };
    let mut table =
        String::from("| crate | folder | depends on | its tests also use |\n|---|---|---|---|\n");
    for c in crates {
        table.push_str(&format!(
            "| `{}` | `{}` | {} | {} |\n",
            c.name,
            c.folder,
            list(&c.uses),
            list(&c.tests_use)
        ));
    }
    table
}

#[test]
fn the_architecture_pages_crate_table_is_what_the_cargo_files_say() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let crates = crate_graph(&root);
    assert!(crates.len() >= 10, "only {} crates read", crates.len());
    let page =
        std::fs::read_to_string(root.join("docs/ARCHITECTURE.md")).expect("docs/ARCHITECTURE.md");
    let (begin, end) = ("<!-- crates: begin -->\n", "<!-- crates: end -->");
    let written = page
        .split_once(begin)
        .and_then(|(_, rest)| rest.split_once(end))
        .map(|(table, _)| table)
        .expect("docs/ARCHITECTURE.md has the crates table between its markers");
    let expected = crates_table(&crates);
    assert!(
        written == expected,
        "docs/ARCHITECTURE.md's crates table is not what the Cargo.toml files say; it should read:\n{expected}"
    );
    // The two sides never depend on each other: the filter's crates on
    // the admin's, nor the admin's on the filter's (their tests may).
    let filter_side = ["sluice-filter", "sluice-filter-core", "sluice-native"];
    let admin_side = ["sluice-admin", "sluice-api", "sluice-ui"];
    for Crate { name, uses, .. } in &crates {
        let other: &[&str] = if filter_side.contains(&name.as_str()) {
            &admin_side
        } else if admin_side.contains(&name.as_str()) {
            &filter_side
        } else {
            &[]
        };
        let crossing: Vec<&String> = uses
            .iter()
            .filter(|u| other.contains(&u.as_str()))
            .collect();
        assert!(crossing.is_empty(), "{name} depends on {crossing:?}");
    }
}

/// Sections of docs/BENCHMARKS.md that lack the line saying when, at which
/// commit and by which command they were measured (`sluice-bench` writes
/// it; sections from the e2e suites carry it by hand).
fn unstamped_sections(page: &str) -> Vec<String> {
    let mut missing = Vec::new();
    let mut lines = page.lines();
    while let Some(line) = lines.next() {
        let Some(heading) = line.strip_prefix("## ") else {
            continue;
        };
        if !heading.starts_with(|c: char| c.is_ascii_digit()) {
            continue;
        }
        let stamp = lines.by_ref().find(|l| !l.trim().is_empty());
        let stamped = stamp.is_some_and(|s| {
            s.starts_with("*Measured ") && s.contains(", commit ") && s.contains(", by `")
        });
        if !stamped {
            missing.push(heading.to_string());
        }
    }
    missing
}

#[test]
fn every_benchmark_section_says_when_and_by_which_command_it_was_measured() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let page = std::fs::read_to_string(root.join("docs/BENCHMARKS.md")).expect("BENCHMARKS.md");
    assert!(page.matches("\n## ").count() >= 12, "sections not found");
    assert_eq!(unstamped_sections(&page), Vec::<String>::new());
    let bare = "## 1. Overhead\n\nCommand: x\n\n## 2. Accuracy\n\n*Measured 2026-12-06, commit abc, by `make bench`.*\n";
    assert_eq!(unstamped_sections(bare), vec!["1. Overhead".to_string()]);
}
