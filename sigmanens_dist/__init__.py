"""sigmanens-dist: train σN-Ens ensembles (a shared backbone with M member σ-norms) at scale."""

from sigmanens_dist.methods.sigma import SigmaEnsemble, convert_to_sigma_ensemble
from sigmanens_dist.sigma.regularizer import diversity_loss, members_on, optimal_members_on

__all__ = ["SigmaEnsemble", "convert_to_sigma_ensemble", "diversity_loss", "members_on", "optimal_members_on"]
__version__ = "0.2.0"
