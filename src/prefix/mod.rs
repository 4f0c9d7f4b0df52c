//! Where each prompt's prefix is cached: the block hashes that name a prefix
//! ([`block_hashes`]), shared by workers, gateways and every router replica, and which
//! workers hold them ([`PrefixIndex`]).

mod hash;
mod index;
mod state;
#[cfg(feature = "tokenizer")]
mod tokenizer;

pub use hash::{block_hashes, chain_block_hash, DEFAULT_BLOCK_SIZE, ROOT_PARENT_HASH};
pub(crate) use index::PrefixImage;
pub use index::{PrefixIndex, PrefixIndexConfig};
pub use state::PrefixFigures;
pub(crate) use state::{PrefixState, RankView};
#[cfg(feature = "tokenizer")]
pub use tokenizer::{LoadTokenizerError, PromptTokenizer, TokenizePromptError};
