"""The KV cache's memory design: specs (what a layer keeps), groups (layers with equal specs)
and their tensors (`layout`), and one manager per spec kind (`managers`, driven by
`tokenwise.engine.block_manager.BlockManager`)."""
