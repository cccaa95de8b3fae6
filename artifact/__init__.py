"""The compiled artifact's runtime half: its format (`manifest`), shapes (`bucketing`), what a batch
costs on each library and so which one runs it (`costs`), the packed layout's inputs
(`packed_batch`), integrity (`hashing`), the CPU it needs and the level this CPU loads
(`cpu_features`, `levels`), the one reader (`loader`), and checkpoints by their Hugging Face Hub
name (`hub`). Shared by the compile stage, which
writes artifacts, and the service and benchmarks, which load them; it needs TVM's runtime only,
never the compile stage.
"""
