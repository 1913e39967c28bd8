{
  description = "builder: reproducible, checkable DGX Spark lanes (pins, lock, images, bundles, audit)";

  inputs.nixpkgs.url = "github:NixOS/nixpkgs/nixos-25.11";

  outputs = { self, nixpkgs }:
    let
      systems = [ "x86_64-linux" "aarch64-linux" ];
      forAll = f: builtins.listToAttrs (map (system: { name = system; value = f system; }) systems);

      # The Python dependencies, by their nixpkgs attribute names. tests/test_flake.py checks
      # that this list matches pyproject.toml's [project.dependencies] (and dev extras).
      # paramiko is a runtime dependency: the docker SDK's ssh:// transport (DOCKER_HOST=ssh://...) needs it.
      pythonDeps = [ "click" "pydantic" "rich" "docker" "huggingface-hub" "cryptography" "pytest-testinfra" "pytest" "paramiko"
                     "packageurl-python" "cyclonedx-python-lib" ];
      pythonDevDeps = [ "hypothesis" "pytest-xdist" "mypy" "vulture" "radon" ];
      # Tools builder calls at run time.
      runtimeTools = [ "git" "docker-client" "zstd" "openssh" "openssl" "minisign" ];

      version = (builtins.fromTOML (builtins.readFile ./pyproject.toml)).project.version;
    in
    {
      # nixpkgs-free outputs: evaluate without fetching anything.
      lib = { inherit pythonDeps pythonDevDeps runtimeTools version; };

      packages = forAll (system:
        let
          pkgs = nixpkgs.legacyPackages.${system};
          py = pkgs.python311Packages;
          builder = py.buildPythonApplication {
            pname = "builder";
            inherit version;
            pyproject = true;
            src = ./.;
            build-system = [ py.setuptools ];
            dependencies = map (n: py.${n}) pythonDeps;
            makeWrapperArgs = [ "--prefix" "PATH" ":" (pkgs.lib.makeBinPath (map (n: pkgs.${n}) runtimeTools)) ];
            doCheck = false;
          };
        in { default = builder; inherit builder; });

      apps = forAll (system: {
        default = { type = "app"; program = "${self.packages.${system}.default}/bin/builder"; };
      });

      devShells = forAll (system:
        let
          pkgs = nixpkgs.legacyPackages.${system};
          python = pkgs.python311.withPackages (ps: map (n: ps.${n}) (pythonDeps ++ pythonDevDeps));
        in {
          default = pkgs.mkShell {
            packages = [ python pkgs.ruff ] ++ map (n: pkgs.${n}) runtimeTools;
            shellHook = ''
              export PYTHONPATH=$PWD''${PYTHONPATH:+:$PYTHONPATH}
            '';
          };
        });
    };
}
