"""PySpark's surface on Dask: ``SparkContext``, ``SparkConf``, ``RDD`` and its operations, ``StorageLevel``
and persistence, RDD I/O, broadcast variables, ``StatCounter``, files for every task (``SparkFiles``), the
``StatusTracker``, and threads that inherit local properties (``InheritableThread``).

Nothing here knows of networks, training, evaluation or monitoring (an import contract in
``pyproject.toml`` holds it); those build on the facade through ``RDD``'s public methods. The public
names are re-exported, lazily, by :mod:`dlscale`.
"""
