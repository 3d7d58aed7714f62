//! The Sluice admin service (built in step 3).

fn main() {
    eprintln!("sluice-admin: not built yet (step 3)");
    std::process::exit(2);
}
