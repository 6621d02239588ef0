// Per-step header, shared by every kernel of a forward step (uniform, 32 bytes).
// The step's small arrays live in one u32 storage buffer `meta`, at the offsets below.
struct Step {
    n_tokens: u32,     // rows of this step's activations
    n_sample: u32,     // rows whose logits are computed and sampled
    n_seqs: u32,       // sequences in this step
    max_blocks: u32,   // block-table row length
    off_pos: u32,      // md[off_pos + t]     position of token t
    off_slot: u32,     // md[off_slot + t]    KV slot (block * block_size + offset) of token t
    off_seq: u32,      // md[off_seq + t]     sequence index of token t
    off_table: u32,    // md[off_table + s * max_blocks + j]  block j of sequence s
}

// Eight weights of one 32-element block, as the weight formats hand them out: part p (0..3)
// holds elements 4p..4p+3 (lo) and 16+4p..16+4p+3 (hi), the nibble order of GGUF's Q4 blocks.
struct Part {
    lo: vec4<f32>,
    hi: vec4<f32>,
}
