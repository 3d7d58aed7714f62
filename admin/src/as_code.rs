//! Policies as code: files (YAML or JSON) that hold policies, read into one
//! policy set in order (files by name, policies in file order), checked with
//! the same validation as the API, every error named by its file and path.
//!
//! A file holds a set as `export` writes it (`{"prices": {...}, "policies":
//! [...]}`, each part optional), a list of policies, or one policy. At most
//! one file gives `prices`; the set's prices are the files' (none given:
//! none), as its policies are.

use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use sluice_shared::price::PriceTable;
use sluice_shared::validate::{policy_from_value, validate_policy_set};
use sluice_shared::{FieldError, Policy, PolicySet, ValidationErrors};

/// Largest file read, and most files in a directory: a policy set is a few
/// hundred policies at most.
pub const MAX_FILE_BYTES: u64 = 1024 * 1024;
pub const MAX_FILES: usize = 1000;
/// The most YAML nodes one file may hold, aliases expanded: a thousand
/// policies of a hundred fields each. An alias bomb (an anchor referenced
/// over and over, each copy expanded) stops here, long before it takes
/// memory or time.
pub const MAX_YAML_NODES: usize = 100_000;

/// A YAML file's document as JSON, within [`MAX_YAML_NODES`] nodes and as
/// many events replayed through aliases. Pure Rust (serde-saphyr), no
/// unsafe code.
pub fn parse_yaml(text: &str) -> Result<Value, String> {
    let options = serde_saphyr::options! {
        budget: serde_saphyr::budget! {
            max_nodes: MAX_YAML_NODES,
            max_events: 2 * MAX_YAML_NODES,
            max_documents: 1,
        },
        alias_limits: serde_saphyr::alias_limits! {
            max_total_replayed_events: MAX_YAML_NODES,
        },
        // One line per error: where, and why.
        with_snippet: false,
    };
    serde_saphyr::from_str_with_options(text, options).map_err(|e| {
        let e = e.to_string();
        if e.contains("budget breached") {
            format!("{e}: a file holds at most {MAX_YAML_NODES} YAML nodes, aliases expanded")
        } else {
            e
        }
    })
}

/// One file's name (as it is to be shown) and text.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SourceFile {
    pub path: String,
    pub text: String,
}

/// Policies read from files, each with the file it came from.
#[derive(Debug, Clone, PartialEq)]
pub struct Loaded {
    pub policies: Vec<Policy>,
    pub sources: Vec<String>,
    /// The set's price table, and the file it came from.
    pub prices: Option<(PriceTable, String)>,
}

impl Loaded {
    pub fn prices(&self) -> Option<PriceTable> {
        self.prices.as_ref().map(|(table, _)| table.clone())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{0}: larger than {MAX_FILE_BYTES} bytes")]
    TooLarge(String),
    #[error("{0}: more than {MAX_FILES} policy files")]
    TooMany(String),
    #[error("{0}: no .yaml, .yml or .json file")]
    Empty(String),
}

fn is_policy_file(path: &Path) -> bool {
    matches!(
        path.extension().and_then(|e| e.to_str()),
        Some("yaml" | "yml" | "json")
    )
}

fn read_one(path: &Path, shown: String) -> Result<SourceFile, ReadError> {
    let io = |source| ReadError::Io {
        path: shown.clone(),
        source,
    };
    let size = std::fs::metadata(path).map_err(io)?.len();
    if size > MAX_FILE_BYTES {
        return Err(ReadError::TooLarge(shown));
    }
    let text = std::fs::read_to_string(path).map_err(io)?;
    Ok(SourceFile { path: shown, text })
}

/// `path` itself, or the policy files directly in the directory `path`,
/// by name. Hidden files (editors' swap files) are skipped.
pub fn read_path(path: &Path) -> Result<Vec<SourceFile>, ReadError> {
    let shown = path.display().to_string();
    let io = |source| ReadError::Io {
        path: shown.clone(),
        source,
    };
    if !std::fs::metadata(path).map_err(io)?.is_dir() {
        return Ok(vec![read_one(path, shown.clone())?]);
    }
    let mut names: Vec<std::path::PathBuf> = std::fs::read_dir(path)
        .map_err(io)?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.is_file() && is_policy_file(p))
        .filter(|p| {
            !p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with('.'))
        })
        .collect();
    if names.len() > MAX_FILES {
        return Err(ReadError::TooMany(shown));
    }
    if names.is_empty() {
        return Err(ReadError::Empty(shown));
    }
    names.sort();
    names
        .iter()
        .map(|p| {
            let name = p
                .file_name()
                .map(|n| n.to_string_lossy().to_string())
                .unwrap_or_default();
            read_one(p, name)
        })
        .collect()
}

/// The file's items: (value, its path inside the file); its `prices`, if
/// it gives them, go to `prices`.
fn items(
    file: &SourceFile,
    prices: &mut Vec<(Value, String)>,
    errors: &mut Vec<FieldError>,
) -> Vec<(Value, String)> {
    let yaml = !file.path.ends_with(".json");
    let parsed: Result<Value, String> = if yaml {
        parse_yaml(&file.text).map_err(|e| format!("not valid YAML: {e}"))
    } else {
        serde_json::from_str(&file.text).map_err(|e| format!("not valid JSON: {e}"))
    };
    let value = match parsed {
        Ok(v) => v,
        Err(message) => {
            errors.push(at(&file.path, "", message));
            return Vec::new();
        }
    };
    match value {
        Value::Object(mut fields)
            if fields.contains_key("policies") || fields.contains_key("prices") =>
        {
            for key in fields
                .keys()
                .filter(|k| !["policies", "prices", "version"].contains(&k.as_str()))
            {
                errors.push(at(
                    &file.path,
                    key,
                    "unknown field, expected `prices` and `policies` (and `version`, ignored)"
                        .into(),
                ));
            }
            if let Some(table) = fields.remove("prices") {
                prices.push((table, file.path.clone()));
            }
            match fields.remove("policies") {
                None => Vec::new(),
                Some(Value::Array(list)) => list
                    .into_iter()
                    .enumerate()
                    .map(|(i, v)| (v, format!("policies[{i}]")))
                    .collect(),
                _ => {
                    errors.push(at(
                        &file.path,
                        "policies",
                        "must be a list of policies".into(),
                    ));
                    Vec::new()
                }
            }
        }
        Value::Array(list) => list
            .into_iter()
            .enumerate()
            .map(|(i, v)| (v, format!("[{i}]")))
            .collect(),
        Value::Object(_) => vec![(value, String::new())],
        Value::Null => Vec::new(),
        _ => {
            errors.push(at(
                &file.path,
                "",
                "must be a policy, a list of policies, or {\"policies\": [...]}".into(),
            ));
            Vec::new()
        }
    }
}

fn join(prefix: &str, path: &str) -> String {
    match (prefix.is_empty(), path.is_empty()) {
        (true, _) => path.to_string(),
        (false, true) => prefix.to_string(),
        (false, false) if path.starts_with('[') => format!("{prefix}{path}"),
        (false, false) => format!("{prefix}.{path}"),
    }
}

fn at(file: &str, path: &str, message: String) -> FieldError {
    FieldError {
        path: if path.is_empty() {
            file.to_string()
        } else {
            format!("{file}: {path}")
        },
        message,
    }
}

/// Rewrites `policies[k]` of the combined set into where policy k came
/// from, in a path or a message.
fn locate(text: &str, origins: &[(String, String)]) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(start) = rest.find("policies[") {
        let after = &rest[start + "policies[".len()..];
        let Some(end) = after.find(']') else { break };
        match after[..end]
            .parse::<usize>()
            .ok()
            .and_then(|k| origins.get(k))
        {
            Some((file, local)) => {
                out.push_str(&rest[..start]);
                if local.is_empty() {
                    out.push_str(file);
                } else {
                    out.push_str(&format!("{file}: {local}"));
                }
                rest = &after[end + 1..];
            }
            None => {
                out.push_str(&rest[..start + "policies[".len()]);
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out
}

/// `policies[3].rate.burst` → (3, "rate.burst").
fn split_index(path: &str) -> Option<(usize, &str)> {
    let rest = path.strip_prefix("policies[")?;
    let (index, rest) = rest.split_once(']')?;
    Some((index.parse().ok()?, rest.strip_prefix('.').unwrap_or(rest)))
}

/// Reads `files` into one policy set, in order, validated as the API
/// validates; every error names its file and path.
pub fn load(files: &[SourceFile]) -> Result<Loaded, ValidationErrors> {
    let mut errors = Vec::new();
    let mut loaded = Loaded {
        policies: Vec::new(),
        sources: Vec::new(),
        prices: None,
    };
    let mut origins = Vec::new();
    let mut price_tables = Vec::new();
    for file in files {
        for (value, local) in items(file, &mut price_tables, &mut errors) {
            match policy_from_value(value) {
                Ok(policy) => {
                    origins.push((file.path.clone(), local));
                    loaded.sources.push(file.path.clone());
                    loaded.policies.push(policy);
                }
                Err(e) => errors.extend(
                    e.errors
                        .into_iter()
                        .map(|e| at(&file.path, &join(&local, &e.path), e.message)),
                ),
            }
        }
    }
    if let [_, (_, second), ..] = price_tables.as_slice() {
        let first = &price_tables[0].1;
        errors.push(at(
            second,
            "prices",
            format!("the set's prices are already given in {first}: one file gives them"),
        ));
    }
    if let Some((table, path)) = price_tables.into_iter().next() {
        let mut table_errors = Vec::new();
        if let Some(table) =
            sluice_shared::validate::typed_at::<PriceTable>(table, "prices", &mut table_errors)
        {
            loaded.prices = Some((table, path.clone()));
        }
        errors.extend(
            table_errors
                .into_iter()
                .map(|e| at(&path, &e.path, e.message)),
        );
    }
    if errors.is_empty() {
        let set = PolicySet {
            version: 1,
            prices: loaded.prices(),
            policies: loaded.policies.clone(),
        };
        if let Err(e) = validate_policy_set(&set) {
            errors.extend(e.errors.into_iter().map(|e| {
                let message = locate(&e.message, &origins);
                let prices_file = loaded.prices.as_ref().map(|(_, file)| file);
                match split_index(&e.path).and_then(|(k, rest)| Some((origins.get(k)?, rest))) {
                    Some(((file, local), rest)) => at(file, &join(local, rest), message),
                    None if e.path.starts_with("prices") && prices_file.is_some() => {
                        at(prices_file.map_or("", String::as_str), &e.path, message)
                    }
                    None => FieldError {
                        path: e.path,
                        message,
                    },
                }
            }));
        }
    }
    if errors.is_empty() {
        Ok(loaded)
    } else {
        Err(ValidationErrors { errors })
    }
}

/// The store's set as a file: `{"prices": {...}, "policies": [...]}` in
/// order (no `prices` when it has none), YAML or JSON. Applying it back
/// changes nothing.
pub fn export(set: &PolicySet, yaml: bool) -> Result<String, String> {
    let doc = match &set.prices {
        Some(prices) => serde_json::json!({ "prices": prices, "policies": set.policies }),
        None => serde_json::json!({ "policies": set.policies }),
    };
    if yaml {
        serde_saphyr::to_string(&doc).map_err(|e| e.to_string())
    } else {
        serde_json::to_string_pretty(&doc)
            .map(|s| s + "\n")
            .map_err(|e| e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(path: &str, text: &str) -> SourceFile {
        SourceFile {
            path: path.into(),
            text: text.into(),
        }
    }

    const BANK: &str =
        "name: bank\nmatch: {host: api.bank.example}\nrate: {requests: 100, period: 1s}\n";

    #[test]
    fn files_of_every_shape_load_in_order_with_their_sources() {
        let loaded = load(&[
            file("a-bank.yaml", BANK),
            file(
                "b-more.json",
                r#"[{"name": "shop", "match": {"host": "*.shop.example"}, "concurrency": {"max_in_flight": 5}}]"#,
            ),
            file(
                "c-set.yml",
                "version: 7\npolicies:\n  - name: any\n    match: {host: '*'}\n    rate: {requests: 1000, period: 1s}\n",
            ),
        ])
        .unwrap();
        let names: Vec<&str> = loaded.policies.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(names, ["bank", "shop", "any"]);
        assert_eq!(loaded.sources, ["a-bank.yaml", "b-more.json", "c-set.yml"]);
    }

    #[test]
    fn every_error_names_its_file_and_path() {
        let errors = load(&[
            file("bank.yaml", "name: bank\nmatch: {host: api.bank.example}\nrate: {requests: 100, period: 1s, burst: 0}\n"),
            file("broken.json", "{\"name\": "),
            file("list.yaml", "- name: x\n  match: {host: x.example}\n  rate: {requests: 0, period: 1s}\n"),
            file("set.yaml", "policies: 3\nextra: 1\n"),
        ])
        .unwrap_err();
        let paths: Vec<&str> = errors.errors.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(
            paths,
            [
                "bank.yaml: rate.burst",
                "broken.json",
                "list.yaml: [0].rate.requests",
                "set.yaml: extra",
                "set.yaml: policies"
            ],
            "{errors:?}"
        );
        assert!(errors.errors[1].message.starts_with("not valid JSON"));
    }

    #[test]
    fn a_name_used_in_two_files_is_refused_naming_both() {
        let errors = load(&[file("one.yaml", BANK), file("two.yaml", BANK)]).unwrap_err();
        assert_eq!(errors.errors.len(), 1, "{errors:?}");
        assert_eq!(errors.errors[0].path, "two.yaml: name");
        assert!(errors.errors[0].message.contains("one.yaml"), "{errors:?}");
    }

    /// A file may give the set's prices beside its policies; one file
    /// only, each bad part named by its file and path.
    #[test]
    fn prices_come_from_one_file_and_their_errors_name_it() {
        const PRICES: &str =
            "prices:\n  currency: USD\n  models:\n    gpt-4o: {input: '2.50', output: 10}\n";
        let loaded = load(&[file("a.yaml", BANK), file("prices.yaml", PRICES)]).unwrap();
        let (table, from) = loaded.prices.clone().unwrap();
        assert_eq!(
            (table.currency.as_str(), from.as_str()),
            ("USD", "prices.yaml")
        );
        let twice = load(&[file("p1.yaml", PRICES), file("p2.yaml", PRICES)]).unwrap_err();
        assert_eq!(twice.errors[0].path, "p2.yaml: prices");
        let bad = PRICES.replace("USD", "XYZ").replace("'2.50'", "'2.5.0'");
        let errors = load(&[file("p.yaml", &bad)]).unwrap_err();
        assert_eq!(errors.errors.len(), 1, "{errors:?}");
        assert!(
            errors.errors[0].path.starts_with("p.yaml: prices.models"),
            "{errors:?}"
        );
        let errors = load(&[file("p.yaml", &PRICES.replace("USD", "XYZ"))]).unwrap_err();
        assert_eq!(
            errors.errors[0].path, "p.yaml: prices.currency",
            "{errors:?}"
        );
    }

    #[test]
    fn an_export_loads_back_as_the_same_policies() {
        let loaded = load(&[file("a.yaml", BANK)]).unwrap();
        let set = PolicySet {
            version: 1,
            prices: loaded.prices(),
            policies: loaded.policies.clone(),
        };
        for yaml in [true, false] {
            let text = export(&set, yaml).unwrap();
            let path = if yaml { "x.yaml" } else { "x.json" };
            assert_eq!(
                load(&[file(path, &text)]).unwrap().policies,
                loaded.policies
            );
        }
    }

    #[test]
    fn a_directory_reads_its_policy_files_by_name_and_skips_the_rest() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("b.yaml"), BANK.replace("bank", "b")).unwrap();
        std::fs::write(dir.path().join("a.json"), r#"{"name": "a", "match": {"host": "a.example"}, "rate": {"requests": 1, "period": "1s"}}"#).unwrap();
        std::fs::write(dir.path().join("notes.txt"), "not a policy").unwrap();
        std::fs::write(dir.path().join(".b.yaml.swp"), "junk").unwrap();
        let files = read_path(dir.path()).unwrap();
        let names: Vec<&str> = files.iter().map(|f| f.path.as_str()).collect();
        assert_eq!(names, ["a.json", "b.yaml"]);
        let empty = tempfile::tempdir().unwrap();
        assert!(matches!(read_path(empty.path()), Err(ReadError::Empty(_))));
        assert!(matches!(
            read_path(&dir.path().join("missing.yaml")),
            Err(ReadError::Io { .. })
        ));
    }

    #[test]
    fn anchors_are_read_and_an_alias_bomb_is_refused() {
        let shared = "common: &limits\n  - {name: day, rate: {requests: 5, period: 1d}}\n\
                      policies:\n  - {name: a, match: {host: a}, rate: {requests: 1, period: 1s}, limits: *limits}\n";
        let value = parse_yaml(shared).unwrap();
        assert_eq!(value["policies"][0]["limits"][0]["name"], "day");
        let bomb = format!(
            "x: &a [{}1]\ny: [{}*a]\n",
            "1,".repeat(2_000),
            "*a,".repeat(100)
        );
        let e = parse_yaml(&bomb).unwrap_err();
        assert!(e.contains("at most 100000 YAML nodes"), "{e}");
    }
}
