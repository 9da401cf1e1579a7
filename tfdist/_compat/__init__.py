"""Corrections of upstream libraries that tfdist applies on a visible line.

`keras` corrects Keras 3's TensorFlow trainer under tf.distribute, where the
installed Keras still has the code each correction was verified on;
`keras_callbacks` makes Keras's writing callbacks write from the chief only.
Nothing in this package imports other tfdist modules, so every floor may use
it; what it needs from above (the error class, the chief rule) is handed to
`keras.apply` as a `keras.Host`.
"""
