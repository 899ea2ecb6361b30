"""The data side, torch-free: a corpus's files and records (corpus.py, records.py), cut into units
(units.py), tokenized by worker processes into token shards (prepare.py, shards.py) kept under
data.cache_dir (prepared.py), Megatron-LM datasets read as they are (megatron.py), the tokenizer
(tokenizer.py), a mixture's blend (mixture.py), and the [data] keys resolved into all of it (sources.py).
`shardwise data prepare` is command.py; train/data.py turns the prepared tokens into batches.
"""
