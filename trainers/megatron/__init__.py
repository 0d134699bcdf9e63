"""The Megatron-core trainer backend (`trainer.kind: megatron`): temper's model built from Megatron's parallel
parts (`model`), the config mapping (`mapping`), HF ↔ Megatron weight converters with tensor- and expert-parallel
shards (`convert`), and the parallel runtime (`parallel`). megatron-core is the optional extra
`pip install 'temper[megatron]'`; `mapping` and `convert` need only torch."""
