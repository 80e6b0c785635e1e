"""Tools a user runs now and then: python tools/NAME.py --help (benchmark, report, gpu_report,
demo_data). They import the project's modules from the folder above."""
