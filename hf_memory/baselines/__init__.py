"""The methods memory is compared with (CAA, visible prompt) behind one interface."""
