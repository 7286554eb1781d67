"""Pre-quantized checkpoints: the one `quantization_config` format tokenmill loads, and the refusal of all others.

Accepted: compressed-tensors int8 W8A8 as vLLM reads it (what llm-compressor's W8A8 int8 recipe writes), and its
fp8 twin (llm-compressor's FP8_DYNAMIC scheme: "format": "float-quantized", "type": "float" for both weights and
input activations, the same strategies; weights stored as float8_e4m3fn):

    "quantization_config": {
      "quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
      "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "int", "symmetric": true, "strategy": "channel", "dynamic": false},
        "input_activations": {"num_bits": 8, "type": "int", "symmetric": true, "strategy": "token",
                              "dynamic": true},
        "output_activations": null}},
      "ignore": ["lm_head"], "kv_cache_scheme": null}

Tensors: each decoder projection's `*.weight` is int8 [out, in] (symmetric, no zero point) and
`*.weight_scale` its per-output-channel scale, [out, 1] (or [out]), any float dtype: w = weight * weight_scale.
Embeddings, norms and lm_head stay float. The weights load straight into `Int8LinearMethod`'s int8 storage
(no re-quantization); activations are quantized per token at run time, as `--quantization int8` does. An fp8
checkpoint loads the same way into `Fp8LinearMethod`'s storage and runs as `--quantization fp8` does (natively on
CUDA sm89+; emulated on CPUs).

Everything else is refused with a `ModelLoadError` naming the key and value: other quant_methods (awq, gptq,
fp8, bitsandbytes, ...), other formats (float-quantized, pack-quantized, naive-quantized, ...), weights other
than 8-bit symmetric int per channel (tensor / group / block strategies, asymmetric, 4-bit), activations other
than dynamic symmetric int8 per token (static scales, none = weight-only), output activations, a KV cache
scheme, sparsity or transforms, targets other than all Linear layers, ignore lists beyond lm_head, a status
other than compressed, and keys this parser does not know (unless null or calibration-only).
"""

from __future__ import annotations

from tokenmill.errors import ModelLoadError

SUPPORTED = ("supported: compressed-tensors int8 or fp8 W8A8 (int-quantized / float-quantized, per-channel weights, "
             "dynamic per-token activations)")
FORMATS = {"int-quantized": ("int", "compressed-tensors-w8a8"), "float-quantized": ("float", "compressed-tensors-w8a8-fp8")}

# keys that only describe how the checkpoint was calibrated or compressed, not the math at load/run time
_TOP_BENIGN = {"global_compression_ratio", "version", "quantization_status"}
_ARGS_BENIGN = {"observer", "observer_kwargs"}
_WEIGHTS = {"num_bits": 8, "symmetric": True, "strategy": "channel", "dynamic": False}  # + "type" by format
_INPUTS = {"num_bits": 8, "symmetric": True, "strategy": "token", "dynamic": True}
_NULLABLE = {"group_size", "block_structure", "actorder", "scale_dtype", "zp_dtype"}  # must be null (or absent)


def _refuse(where: str, key: str, value, why: str = "") -> None:
    raise ModelLoadError(f"{where}: quantization_config.{key}={value!r} is not supported"
                         f"{' (' + why + ')' if why else ''}; {SUPPORTED}")


def _check_args(where: str, key: str, args, want: dict) -> None:
    if not isinstance(args, dict):
        _refuse(where, key, args)
    for k, v in want.items():
        if args.get(k, None if k != "dynamic" else False) != v:
            _refuse(where, f"{key}.{k}", args.get(k))
    for k, v in args.items():
        if k in want or k in _ARGS_BENIGN:
            continue
        if k in _NULLABLE:
            if not (v is None or (k == "group_size" and v == -1) or (k == "actorder" and v is False)):
                _refuse(where, f"{key}.{k}", v)
            continue
        if v is not None:
            _refuse(where, f"{key}.{k}", v, "unknown key")


def parse_quantization_config(qc, where: str) -> str:
    """config.json's `quantization_config` -> the checkpoint format tokenmill loads ("compressed-tensors-w8a8" or
    "compressed-tensors-w8a8-fp8"), or a ModelLoadError naming the first unsupported key and its value."""
    if not isinstance(qc, dict):
        _refuse(where, "", qc, "expected an object")
    method = qc.get("quant_method")
    if method != "compressed-tensors":
        _refuse(where, "quant_method", method)
    known = {"quant_method", "format", "config_groups", "ignore", "kv_cache_scheme", "sparsity_config",
             "transform_config", *_TOP_BENIGN}
    for k, v in qc.items():
        if k not in known and v is not None:
            _refuse(where, k, v, "unknown key")
    fmt = qc.get("format")
    if fmt not in FORMATS:
        _refuse(where, "format", fmt)
    value_type, kind = FORMATS[fmt]
    if qc.get("quantization_status", "compressed") != "compressed":
        _refuse(where, "quantization_status", qc.get("quantization_status"),
                "only compressed checkpoints store int8 weights")
    for k in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        if qc.get(k):
            _refuse(where, k, qc[k])
    ignore = qc.get("ignore") or []
    if not isinstance(ignore, list) or any(x != "lm_head" for x in ignore):
        _refuse(where, "ignore", ignore, "every decoder projection must be quantized; only lm_head may be ignored")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or len(groups) != 1:
        _refuse(where, "config_groups", groups, "exactly one group expected")
    (name, group), = groups.items()
    key = f"config_groups.{name}"
    if not isinstance(group, dict):
        _refuse(where, key, group)
    for k, v in group.items():
        if k not in ("targets", "weights", "input_activations", "output_activations", "format") and v is not None:
            _refuse(where, f"{key}.{k}", v, "unknown key")
    if group.get("format", fmt) != fmt:
        _refuse(where, f"{key}.format", group.get("format"), f"the checkpoint's format is {fmt!r}")
    if group.get("targets") != ["Linear"]:
        _refuse(where, f"{key}.targets", group.get("targets"), "all Linear layers expected")
    _check_args(where, f"{key}.weights", group.get("weights"), {**_WEIGHTS, "type": value_type})
    _check_args(where, f"{key}.input_activations", group.get("input_activations"), {**_INPUTS, "type": value_type})
    if group.get("output_activations") is not None:
        _refuse(where, f"{key}.output_activations", group["output_activations"])
    return kind
