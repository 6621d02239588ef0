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
