"""The Megatron-core trainer backend (`trainer.kind: megatron`): temper's model built from Megatron's parallel
parts (`model`), the config mapping (`mapping`), HF ↔ Megatron weight converters with tensor- and expert-parallel
shards (`convert`), HF ↔ Megatron-core's own GPTModel names, as Megatron-LM and Megatron Bridge save GLM-5 /
DeepSeek-V3.2 (`mcore`), and the parallel runtime (`parallel`). megatron-core is the optional extra
`pip install 'temper[megatron]'`; `mapping`, `convert` and `mcore` need only torch."""
