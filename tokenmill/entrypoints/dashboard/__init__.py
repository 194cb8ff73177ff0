"""The live web view of ``tokenmill serve`` at ``/dashboard``.

``timeseries.DashboardStatLogger`` keeps the last minutes of engine statistics in memory
(one point per few seconds); ``routes`` serves the page, its static files (uPlot 1.6.32,
MIT, vendored from the npm registry: no CDN) and the JSON the page polls.
"""
