"""snack.core: the COO format and everything that needs no GPU (validation, sorting, conversion,
random topologies, reference ops, the CPU backend)."""
from .coo import COO, Topology, validate_coo, canonicalize, INDEX_DTYPE
from .topology import uniform_indices, erdos_renyi_density, erk_densities, density_to_nnz
from .reference import spmm_reference, spmm_t_reference, sddmm_reference

__all__ = ["COO", "Topology", "validate_coo", "canonicalize", "INDEX_DTYPE", "uniform_indices",
           "erdos_renyi_density", "erk_densities", "density_to_nnz", "spmm_reference",
           "spmm_t_reference", "sddmm_reference"]
