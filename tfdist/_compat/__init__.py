"""Corrections of upstream libraries that tfdist applies on a visible line.

`keras` corrects Keras 3's TensorFlow trainer under tf.distribute, where the
installed Keras still has the code each correction was verified on. tfdist's
own features on Keras live beside what installs them
(`tfdist.strategy.keras_hooks`, `tfdist.strategy.keras_callbacks`).
Nothing in this package imports other tfdist modules, so every floor may use
it; what it needs from above (the error class, the chief rule) is handed to
`keras.apply` as a `keras.Host`.
"""
