"""The compiled artifact's runtime half: its format (`manifest`), shapes (`bucketing`), the packed
layout's inputs (`packed_batch`), integrity (`hashing`), the CPU it needs (`cpu_features`) and the
one reader (`loader`). Shared by the compile
stage, which writes artifacts, and the service and benchmarks, which load them; it needs TVM's
runtime only, never the compile stage.
"""
