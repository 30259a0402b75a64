"""The KV cache: `KVManager`, the one owner of every cache operation, the prompt cache in RAM and on
disk, snapshot files, what left each conversation's context."""
