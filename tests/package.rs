//! The Debian package, installed as a user installs it: `dpkg -i` into Debian's PostgreSQL where
//! nothing of the extension is left from a build, `CREATE EXTENSION`, an event relayed to Redis,
//! then `dpkg -r` leaving no file behind.
//!
//! It changes the system's PostgreSQL installation, so it runs only when asked:
//! `scripts/test.sh` builds the package (`scripts/package.sh`) and runs this test with
//! `OUTBOX_TEST_PACKAGE` naming it, after the rest of the suite.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::{wait_until, Pg, Redis};

fn run(command: &mut Command) -> String {
    let output = command.output().expect("cannot run a command");
    assert!(
        output.status.success(),
        "{command:?} failed: {}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn pg_config(flag: &str) -> PathBuf {
    let pg_config = std::env::var("PG_CONFIG")
        .unwrap_or_else(|_| "/usr/lib/postgresql/15/bin/pg_config".into());
    PathBuf::from(run(Command::new(pg_config).arg(flag)).trim())
}

/// The files of the extension in the server's directories, whoever put them there.
fn installed_files(libdir: &Path, extdir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(extdir)
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| {
            let name = path.file_name().unwrap().to_string_lossy();
            name == "outbox.control" || (name.starts_with("outbox--") && name.ends_with(".sql"))
        })
        .collect();
    let library = libdir.join("outbox.so");
    if library.exists() {
        files.push(library);
    }
    files.sort();
    files
}

fn package_status(name: &str) -> String {
    let output = Command::new("dpkg-query")
        .args(["-W", "-f=${db:Status-Status}", name])
        .output()
        .unwrap();
    String::from_utf8_lossy(&output.stdout).into_owned()
}

#[test]
#[ignore = "installs a package system-wide; scripts/test.sh runs it with OUTBOX_TEST_PACKAGE"]
fn the_debian_package_installs_relays_and_removes_cleanly() {
    let deb = std::env::var("OUTBOX_TEST_PACKAGE")
        .expect("OUTBOX_TEST_PACKAGE must name the .deb that scripts/package.sh built");
    let name = run(Command::new("dpkg-deb").args(["--field", &deb, "Package"]))
        .trim()
        .to_string();
    let (libdir, extdir) = (
        pg_config("--pkglibdir"),
        pg_config("--sharedir").join("extension"),
    );

    // What `cargo pgrx install` put there goes first: only the package's files remain.
    for file in installed_files(&libdir, &extdir) {
        std::fs::remove_file(&file).unwrap();
    }
    assert_eq!(installed_files(&libdir, &extdir), Vec::<PathBuf>::new());

    run(Command::new("dpkg").args(["-i", &deb]));
    assert_eq!(package_status(&name), "installed");
    let everything: Vec<PathBuf> = run(Command::new("dpkg").args(["-L", &name]))
        .lines()
        .map(PathBuf::from)
        .collect();
    let listed: Vec<PathBuf> = everything
        .iter()
        .filter(|path| path.is_file())
        .cloned()
        .collect();
    // Directories of its own, such as /usr/share/doc/<name>, go with it.
    let own_directories: Vec<&PathBuf> = everything
        .iter()
        .filter(|path| path.is_dir() && path.to_string_lossy().contains(&name))
        .collect();
    assert!(!own_directories.is_empty(), "{everything:?}");
    let ours = installed_files(&libdir, &extdir);
    assert!(
        ours.contains(&libdir.join("outbox.so"))
            && ours.contains(&extdir.join("outbox.control"))
            && ours.contains(&extdir.join(format!("outbox--{}.sql", common::extension_version()))),
        "the package put {ours:?} where PostgreSQL looks"
    );
    for file in &ours {
        assert!(
            listed.contains(file),
            "{} is not the package's",
            file.display()
        );
    }

    {
        let redis = Redis::start();
        let pg = Pg::relaying_to(&redis, &[("outbox.poll_interval", "100ms")]);
        let mut client = pg.with_extension();
        let version: String = client
            .query_one(
                "SELECT extversion FROM pg_extension WHERE extname = 'outbox'",
                &[],
            )
            .unwrap()
            .get(0);
        assert_eq!(version, common::extension_version());
        let id: i64 = client
            .query_one(
                "SELECT outbox_enqueue('packaged', '{\"from\": \"the package\"}')",
                &[],
            )
            .unwrap()
            .get(0);
        assert!(
            wait_until(Duration::from_secs(10), || redis.ids("packaged") == [id]),
            "the packaged relay did not publish the event"
        );
    }

    run(Command::new("dpkg").args(["-r", &name]));
    assert!(
        ["not-installed", ""].contains(&package_status(&name).as_str()),
        "{name} is still {}",
        package_status(&name)
    );
    let left: Vec<&PathBuf> = listed
        .iter()
        .chain(own_directories)
        .filter(|path| path.exists())
        .collect();
    assert!(left.is_empty(), "dpkg -r left {left:?}");
    assert_eq!(installed_files(&libdir, &extdir), Vec::<PathBuf>::new());
}
