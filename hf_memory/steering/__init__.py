"""Memory steering at run time: the mixture, the site plan, the stock kernel beside it, the handle
and its call scope.
"""
