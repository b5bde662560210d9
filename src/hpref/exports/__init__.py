"""The reward/judge export format: one home for what an exported preference model's folder holds.

`layout`                 every file name, the format versions, `is_export_folder` /
                         `is_adapter_export` and the metadata readers (`hpref_model.json`,
                         `hpref_adapter.json`, `hpref save`'s `hpref_checkpoint.json`); imports no
                         torch, so `hpref --help`, recipe checks and `hpref serve`'s option checks
                         read it
`files`                  writing and reading the tensor files: `PreferenceModel.save_pretrained`'s
                         folder (transformers' one-label sequence classifier for a last- or
                         first-token reward model), an adapter export (`hpref save --adapter`), a
                         trained head read back
`sentence_transformers`  a mean-pooled reward model's sentence-transformers modules

Writers and readers elsewhere call these: `hpref.models.preference` (save_pretrained),
`hpref.models.adapters` (save_adapter), `hpref.models.hf` (load_exported),
`hpref.evaluate.adapter_export`, `hpref.builtin.scoring` and `hpref.save`; building a model from
what an export says stays with the models (this package sits below them: docs/architecture.md).
"""
