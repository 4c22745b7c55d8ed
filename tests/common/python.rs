//! Python virtual environments for the tests that run Python (the examples, the CloudEvents
//! SDK): made under the repository's `target/`, given a requirements file from PyPI, once.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Mutex;

/// One install at a time: two tests may need the same one.
static INSTALLING: Mutex<()> = Mutex::new(());

fn output(cmd: &mut Command) -> Output {
    cmd.output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"))
}

/// The Python of the virtual environment `venv`, made and given `requirements` unless it has
/// them already.
pub fn venv(venv: &Path, requirements: &Path) -> PathBuf {
    let _installing = INSTALLING.lock().unwrap_or_else(|e| e.into_inner());
    let wanted = fs::read_to_string(requirements)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", requirements.display()));
    let python = venv.join("bin/python");
    // A copy of the requirements installed, written once they are.
    let installed = venv.join("installed-requirements.txt");
    if fs::read_to_string(&installed).ok().as_deref() == Some(wanted.as_str()) {
        return python;
    }
    eprintln!(
        "==> Installing {} into a virtual environment, {} (python3 -m venv, pip install -r; from PyPI)",
        wanted
            .lines()
            .filter(|line| !line.starts_with('#'))
            .collect::<Vec<_>>()
            .join(" "),
        venv.display()
    );
    let _ = fs::remove_dir_all(venv);
    let made = output(Command::new("python3").arg("-m").arg("venv").arg(venv));
    assert!(
        made.status.success(),
        "python3 -m venv {} failed (on Debian and Ubuntu it needs the package python3-venv, which \
         scripts/setup.sh installs):\n{}",
        venv.display(),
        String::from_utf8_lossy(&made.stderr)
    );
    let pip = output(
        Command::new(&python)
            .args(["-m", "pip", "install", "--disable-pip-version-check"])
            .args([
                "--no-input",
                "--quiet",
                "--retries",
                "2",
                "--timeout",
                "30",
                "-r",
            ])
            .arg(requirements)
            // PyPI only: no folder of wheels outside the repository.
            .env_remove("PIP_FIND_LINKS"),
    );
    assert!(
        pip.status.success(),
        "pip could not install {} (does this machine reach PyPI?):\n{}{}",
        requirements.display(),
        String::from_utf8_lossy(&pip.stdout),
        String::from_utf8_lossy(&pip.stderr)
    );
    fs::write(&installed, wanted).expect("cannot write installed-requirements.txt");
    python
}
