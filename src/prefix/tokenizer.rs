//! Prompt text to token ids, for route requests that carry text instead of ids (feature
//! `tokenizer`): a Hugging Face `tokenizer.json`, the file every model on the Hub ships.
//!
//! The ids are only as good as the text: it must be exactly what the engine will tokenize
//! (after its chat template), and the file must be the model's own.

use std::path::{Path, PathBuf};

/// A tokenizer loaded from a `tokenizer.json`.
pub struct PromptTokenizer {
    path: PathBuf,
    inner: tokenizers::Tokenizer,
}

impl std::fmt::Debug for PromptTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PromptTokenizer")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

/// A `tokenizer.json` that could not be loaded.
#[derive(Debug, thiserror::Error)]
#[error("the tokenizer file {path} does not load: {reason}")]
pub struct LoadTokenizerError {
    /// The file.
    pub path: PathBuf,
    /// What the loader said.
    pub reason: String,
}

/// Prompt text that could not be tokenized.
#[derive(Debug, thiserror::Error)]
#[error("the prompt text could not be tokenized: {0}")]
pub struct TokenizePromptError(String);

impl PromptTokenizer {
    /// Loads `path` (a Hugging Face `tokenizer.json`).
    ///
    /// # Errors
    /// [`LoadTokenizerError`] for a file that cannot be read or is not a tokenizer.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, LoadTokenizerError> {
        let path = path.as_ref().to_owned();
        let inner = tokenizers::Tokenizer::from_file(&path).map_err(|err| LoadTokenizerError {
            path: path.clone(),
            reason: err.to_string(),
        })?;
        Ok(Self { path, inner })
    }

    /// Where it was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The token ids of `text`, special tokens added as the tokenizer's own post-processor
    /// adds them (what vLLM's completions API does with a prompt).
    ///
    /// # Errors
    /// [`TokenizePromptError`] when the tokenizer refuses the text.
    pub fn token_ids(&self, text: &str) -> Result<Vec<u32>, TokenizePromptError> {
        self.inner
            .encode(text, true)
            .map(|encoding| encoding.get_ids().to_vec())
            .map_err(|err| TokenizePromptError(err.to_string()))
    }
}
