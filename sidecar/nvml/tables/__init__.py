"""Per-model MIG tables, one module per GPU family; every row names its source in a comment.

Source tags used in the rows:

* ``lgip:<where>`` — a real ``nvidia-smi mig -lgip`` listing quoted in a public issue or PR;
* ``UG`` — the NVIDIA MIG user guide (v580), supported-mig-profiles tables;
* ``unverified`` — no public listing confirms the value; it follows the family's pattern and the
  profile-name rule (``profiles.profile_gb``). ``hami-mig-sidecar probe`` on a real GPU settles it.

Memory sizes are ``memorySizeMB`` (MiB); a listing's GiB column is that value / 1024 to two places.
"""
