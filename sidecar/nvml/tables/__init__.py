"""Per-model MIG tables, one module per GPU family; every row names its source in a comment.

Source tags used in the rows:

* ``lgip:<where>`` — a real ``nvidia-smi mig -lgip`` listing quoted in a public issue or PR;
* ``UG`` — the NVIDIA MIG user guide (v580), supported-mig-profiles tables;
* ``unverified`` — no public listing confirms the value; it follows the family's pattern and the
  profile-name rule (``profiles.profile_gb``). ``hami-mig-sidecar probe`` on a real GPU settles it.

Memory sizes are ``memorySizeMB`` (MiB); a listing's GiB column is that value / 1024 to two places.
"""

# A second source: go-nvml's mock GPUs (github.com/NVIDIA/go-nvml/pkg/nvml/mock/gpus, A100 40/80 GB,
# A30, H100 80 GB, H200, B200), compared profile by profile in ``integration/goclient/hwtruth``.
# Slices and instance counts agree on every model. Where they differ, the listings cited in these
# tables win, and the check fails on any difference not of these kinds:
#
# * ID: the mock answers the profile index (NVML_GPU_INSTANCE_PROFILE_*) as the ID; real drivers
#   answer 19/20/15/14/9/5/0 (Ampere A30: 14/21/5/6/0), as every lgip listing shows;
# * memory: the mock gives the profile name's GB (1g.10gb = 10240 MiB) or near it; listings give
#   less (H100 1g.10gb 9.75 GiB; H200 1g.18gb 16.00 GiB, the largest gap, mig-parted issue #120);
# * SMs: the mock multiplies the 1g SM count by the slices (H100 7g: 112); listings show 132 for
#   7g.80gb, 60 for 3g.40gb and 26 for the double-memory 1g.20gb (Hopper and Blackwell);
# * placement sizes: the mock sizes placements in compute slices (3g at 0:3, 7g at 0:7); NVML sizes
#   them in memory slices (3g.40gb at 0:4 and 4:4, 7g at 0:8, lgipp on H100 80GB);
# * the double-memory 1g (1g.20gb, 1g.35gb, 1g.45gb): the mock lists the plain 1g placements
#   (0..6, size 1); NVML places it at 0/2/4/6, two memory slices each.
