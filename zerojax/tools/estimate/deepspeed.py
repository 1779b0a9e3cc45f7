"""DeepSpeed's model-state estimators, transcribed so their numbers can be set beside the plan's.

From `deepspeed.runtime.zero.stage_1_and_2.estimate_zero2_model_states_mem_needs` and
`deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs`: same arguments, same
arithmetic, same integer results, so a row compares with what DeepSpeed's `*_all_cold` tables print.
Model states only (parameters, gradients, optimizer state); pure arithmetic.
"""
from __future__ import annotations


def deepspeed_zero2(total_params: int, num_gpus_per_node: int = 1, num_nodes: int = 1,
                    cpu_offload: bool = True, additional_buffer_factor: float = 1.5) -> tuple[int, int]:
    """(cpu_mem per node, gpu_mem per GPU) in bytes, as DeepSpeed's
    `estimate_zero2_model_states_mem_needs` (deepspeed/runtime/zero/stage_1_and_2.py) computes them
    for ZeRO stages 1 and 2 with mixed-precision Adam.

    On the GPU: 2 bytes/param of 16-bit parameters, plus - without offload - 18 bytes/param split
    over all GPUs (16-bit and 32-bit gradients, fp32 master, two Adam moments). On the CPU: the
    offloaded 16 bytes/param (at least 4 per GPU of the node) times the buffer factor; without
    offload, 4 bytes/param per GPU for loading the model.
    """
    total_gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        gpu_mem = 2 * total_params
        cpu_mem = total_params * max(4 * total_gpus, 16) * additional_buffer_factor
    else:
        gpu_mem = 2 * total_params + int(18 * total_params / total_gpus)
        cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem)


def deepspeed_zero3(total_params: int, largest_layer_params: int, num_gpus_per_node: int = 1,
                    num_nodes: int = 1, cpu_offload: bool = True, cpu_offload_params: bool = True,
                    zero_init: bool = True, additional_buffer_factor: float = 1.5) -> tuple[int, int, int]:
    """(cpu_mem per node, gpu_mem per GPU, largest_layer_memory) in bytes, as DeepSpeed's
    `estimate_zero3_model_states_mem_needs` (deepspeed/runtime/zero/stage3.py) computes them.

    The GPU always holds the largest layer gathered (4 bytes/param: 16-bit parameters and
    gradients), plus the 16-bit parameter shard (2/N bytes/param) unless parameters are offloaded,
    plus the 18/N bytes/param of gradients and optimizer state unless the optimizer is offloaded.
    The CPU (per node: `1/num_nodes` of the offloaded 18 or 16 bytes/param) is scaled by the
    buffer factor; without `zero_init` every GPU process first loads the whole model (4 bytes/param).
    """
    total_gpus = num_nodes * num_gpus_per_node
    gpus_factor = 1 / num_nodes
    largest_layer_memory = 4 * largest_layer_params
    if cpu_offload:
        if cpu_offload_params:
            gpu_mem = largest_layer_memory
            if zero_init:
                cpu_mem = total_params * 18 * gpus_factor * additional_buffer_factor
            else:
                cpu_mem = total_params * max(4 * num_gpus_per_node, 18 * gpus_factor) * additional_buffer_factor
        else:
            gpu_mem = largest_layer_memory + int(2 * total_params / total_gpus)
            if zero_init:
                cpu_mem = total_params * 16 * gpus_factor * additional_buffer_factor
            else:
                cpu_mem = total_params * max(4 * num_gpus_per_node, 16 * gpus_factor) * additional_buffer_factor
    else:
        gpu_mem = largest_layer_memory + int(18 * total_params / total_gpus)
        if zero_init:
            cpu_mem = largest_layer_params * 4 * num_gpus_per_node * additional_buffer_factor
        else:
            cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem), largest_layer_memory

