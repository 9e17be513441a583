"""Engine core shared by the prefill and decode pools."""
