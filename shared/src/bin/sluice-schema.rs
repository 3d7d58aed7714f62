//! Prints the JSON Schema of the policy format (`make schema` writes it to
//! `docs/policy.schema.json`).

#![forbid(unsafe_code)]

fn main() {
    let schema = sluice_shared::policy_set_schema();
    match serde_json::to_string_pretty(&schema) {
        Ok(text) => println!("{text}"),
        Err(e) => {
            eprintln!("sluice-schema: cannot render the schema: {e}");
            std::process::exit(1);
        }
    }
}
