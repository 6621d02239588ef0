//! The blocks that several families' layers are made of, each with its config, its weights and
//! its ops: the attention mixer and its variants (`attention`), a mixture of experts (`moe`;
//! `experts`, the one loader of every format's experts; `parallel_moe`, a dense FFN beside the
//! experts), the Gated DeltaNet's recurrent mixer (`delta_net`), per-layer embeddings (`ple`), a
//! multi-token-prediction head (`mtp`). A block never names a family: the families' configs
//! switch blocks on (model/families/).

pub mod attention;
pub mod delta_net;
pub mod experts;
pub mod moe;
pub mod mtp;
pub mod parallel_moe;
pub mod ple;
