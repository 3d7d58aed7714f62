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
