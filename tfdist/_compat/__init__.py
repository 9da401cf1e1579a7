"""Corrections of upstream libraries that tfdist applies on a visible line.

`keras` corrects Keras 3's TensorFlow trainer under tf.distribute; nothing in
this package imports other tfdist modules, so every floor may use it.
"""
