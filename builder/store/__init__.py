"""Where locked bytes live here: the content store of image inputs (content), the model store of
Hub-layout model files (modelstore, filled by modelfetch from the Hub or a kit), and where each file
lands on a host (placement)."""
